"""Run one doc_code example as a new driver of the test module's running cluster (``RDT_DOC_CODE_ADDRESS``).

An example starts a local cluster of its own (``ray.init(num_cpus=..., include_dashboard=False)``), as a user runs
it. Here its ``ray.init`` joins the test's cluster instead, with the arguments that only size or shape a new cluster
dropped: everything else (its job's runtime_env, log_to_driver, its actors, rdt) runs as written. Starting and
stopping a cluster per example cost about 10 CPU-seconds each on the two-core CI machine.

Usage: python tests/_doc_code_driver.py doc_code/<example>.py
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import ray

NEW_CLUSTER_ONLY = ("num_cpus", "num_gpus", "resources", "object_store_memory", "include_dashboard",
                    "dashboard_host", "dashboard_port", "_system_config", "_temp_dir")
_init = ray.init


def _join(*args: Any, **kwargs: Any) -> Any:
    """ray.init joining the running cluster: what sizes a new cluster is dropped, the rest passed on."""
    for name in NEW_CLUSTER_ONLY:
        kwargs.pop(name, None)
    kwargs.pop("address", None)
    return _init(*args, address=os.environ["RDT_DOC_CODE_ADDRESS"], **kwargs)


def main() -> None:
    example = os.path.abspath(sys.argv[1])
    sys.argv = [example, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(example)  # as `python doc_code/<example>.py` sets it
    ray.init = _join  # type: ignore[assignment]
    runpy.run_path(example, run_name="__main__")


if __name__ == "__main__":
    main()
