"""Where this process stands in Ray: node, actor or not, current task (cheap lookups, never raising)."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import ray

from .hooks import is_wrapper, worker_mode  # private Ray APIs, checked when rdt is imported


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


_RAY_WORKER_FILE = os.path.join("ray", "_private", "worker.py")


def is_get_objects(code: Any) -> bool:
    """Whether ``code`` is Ray's ``Worker.get_objects`` (the ``ray.get`` path into deserialization)."""
    return code.co_name == "get_objects" and code.co_filename.endswith(_RAY_WORKER_FILE)


def called_by_ray_get() -> bool:
    """Whether Ray is deserializing a value for ``ray.get`` (True) rather than for a task's arguments.

    A private Ray detail, kept here alone: ``ray.get`` reaches ``Worker.deserialize_objects`` from
    ``Worker.get_objects`` (both in ray/_private/worker.py); task arguments reach it from Ray's Cython task loop
    (or the event loop, for async actors). ``await ref`` in an async actor arrives from Cython too and counts as
    an argument. rdt's own wrapper of ``deserialize_objects`` (rdt._consumer.parallel_fetch) is looked through.
    tests/test_control_plane.py::test_ray_deserialization_probe_still_tells_get_from_task_arguments
    fails when Ray changes this.
    """
    frame = sys._getframe(1)
    for _ in range(64):  # bounded: the value is at most a few dozen frames below Ray's entry point
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "deserialize_objects" and code.co_filename.endswith(_RAY_WORKER_FILE):
            caller = frame.f_back
            while caller is not None and is_wrapper(caller.f_code):
                caller = caller.f_back
            return caller is not None and is_get_objects(caller.f_code)
        frame = frame.f_back
    return False
