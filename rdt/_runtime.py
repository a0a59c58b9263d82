"""Where this process stands in Ray: node, actor or not, current task (cheap lookups, never raising)."""

from __future__ import annotations

from typing import Optional

import ray

from ._ray_hooks import worker_mode  # a private Ray API, checked when rdt is imported


def node_id() -> str:
    """This process's Ray node id ("" outside Ray)."""
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""


def in_actor() -> bool:
    """Whether this process is a Ray actor."""
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def task_id() -> Optional[str]:
    """The running task's id in a worker (None on the driver, where Ray would warn for asking)."""
    if worker_mode() != ray.WORKER_MODE:
        return None
    try:
        return ray.get_runtime_context().get_task_id()
    except Exception:
        return None
