"""``ray.get`` on the driver works for every transport; each uses the best path the driver has.

- gloo object: the driver is in no group, so the producer actor serves the bytes through Ray's object store;
- shm object: the driver maps the producer's shared-memory segment (same node);
- nixl object: the driver READs the producer's registered memory with its own NIXL agent.

Run: python doc_code/driver_get.py
"""

import os

# Loopback only, and quiet transport libraries; set before Ray starts so its workers inherit them.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import importlib.util  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402

HAS_NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu13", "nixl_cu12"))
N = 1 << 18  # 1 MiB of float32


@ray.remote(num_cpus=0)
class Producer:
    @rdt.tensor_method(tensor_transport="gloo")
    def make_gloo(self):
        return {"w": torch.full((N,), 1.0)}

    @rdt.tensor_method(tensor_transport="shm")
    def make_shm(self):
        return {"w": torch.full((N,), 2.0)}

    @rdt.tensor_method(tensor_transport="nixl")
    def make_nixl(self):
        return {"w": torch.full((N,), 3.0)}


ray.init(num_cpus=4, include_dashboard=False)
p = Producer.remote()


def fetched(path):
    return rdt.stats()["transfers"].get(path, {}).get("in", 0)  # this process's (the driver's) counters


assert float(ray.get(p.make_gloo.remote())["w"].sum()) == 1.0 * N
assert fetched("object_store") == 1

assert float(ray.get(p.make_shm.remote())["w"].sum()) == 2.0 * N
assert fetched("shm") == 1

if HAS_NIXL:
    assert float(ray.get(p.make_nixl.remote())["w"].sum()) == 3.0 * N
    assert fetched("nixl") == 1
else:
    print("nixl is not installed: skipped the nixl object")

ray.shutdown()
print("driver_get: OK")
