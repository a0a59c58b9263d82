"""Every private Ray API rdt and rdt_transports rely on, checked once when rdt is imported.

Ray does not promise these across releases, so the declared dependency is pinned to the range the tests ran
against (``SUPPORTED_RAY``, the same string as in pyproject.toml), and a Ray that lacks one fails at import with
:class:`RayHookMissingError` naming the hook, instead of failing (or silently leaking objects) later. rdt calls
the hooks through the functions below; rdt_transports' uses (GCS key-value store, actor state) are checked here.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, List, Set, Tuple

import ray

from rdt_transports.errors import BackendUnavailableError

SUPPORTED_RAY = "ray>=2.57,<2.61"

# (module, attribute path, what rdt uses it for)
HOOKS: Tuple[Tuple[str, str, str], ...] = (
    ("ray._raylet", "CoreWorker.add_object_out_of_scope_callback", "freeing an object when its last ref dies"),
    ("ray._private.worker", "global_worker", "the process's worker (mode, core worker)"),
    ("ray.experimental.internal_kv", "_internal_kv_initialized", "group rendezvous in the GCS"),
    ("ray.experimental.internal_kv", "_internal_kv_put", "group rendezvous in the GCS"),
    ("ray.experimental.internal_kv", "_internal_kv_get", "group rendezvous in the GCS"),
    ("ray.experimental.internal_kv", "_internal_kv_del", "group rendezvous in the GCS"),
    ("ray.experimental.internal_kv", "_internal_kv_list", "group rendezvous in the GCS"),
    ("ray._private.state", "actors", "naming a dead peer actor in errors"),
    ("ray._private.worker", "Worker.deserialize_objects",
     "starting the fetches of every rdt object of one ray.get / task's arguments before waiting on any"),
    ("ray.actor", "_modify_class", "__ray_call__ on every actor (stats, group set-up, object-store fallback)"),
    ("ray._private.function_manager", "FunctionActorManager._make_actor_method_executor",
     "fetching an async actor method's ref arguments off its event loop"),
    ("ray._raylet", "CoreWorker.get_current_task_function_name",
     "telling which actor method's arguments are being deserialized"),
)


class RayHookMissingError(BackendUnavailableError):
    """The installed Ray lacks a private API rdt needs (rdt supports only the Ray versions it was tested on)."""


def _lookup(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _has_ray_call() -> bool:
    """Whether Ray still gives every actor class a ``__ray_call__`` method."""
    probe = _lookup("ray.actor", "_modify_class")(type("_RdtProbe", (), {}))
    return callable(getattr(probe, "__ray_call__", None))


def missing() -> List[str]:
    """``module.attribute`` of each hook the installed Ray lacks (empty when all are there)."""
    out = []
    for module, path, _why in HOOKS:
        try:
            _lookup(module, path)
        except (ImportError, AttributeError):
            out.append(f"{module}.{path}")
    if not out:
        try:
            if not _has_ray_call():
                out.append("ray.actor.ActorClass.__ray_call__")
        except Exception:
            out.append("ray.actor.ActorClass.__ray_call__")
    return out


def check() -> None:
    """Raise :class:`RayHookMissingError` if any hook is missing."""
    gone = missing()
    if gone:
        uses = {f"{m}.{p}": why for m, p, why in HOOKS}
        what = "; ".join(f"{g} ({uses.get(g, 'calling into actors')})" for g in gone)
        raise RayHookMissingError(
            f"rdt needs private Ray APIs missing from the installed ray {ray.__version__}: {what}.",
            hint=f"install a supported Ray ({SUPPORTED_RAY}), e.g. pip install '{SUPPORTED_RAY}'")


def add_out_of_scope_callback(token: Any, callback: Callable[[Any], None]) -> bool:
    """Call ``callback`` once every reference to ObjectRef ``token`` is gone; False if Ray refused."""
    return bool(ray._private.worker.global_worker.core_worker.add_object_out_of_scope_callback(token, callback))


def wrap_deserialize_objects(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``Worker.deserialize_objects`` by ``wrap(original)``, once per process (rdt._consumer.parallel_fetch);
    frame walks look through the wrapper (:func:`is_wrapper`)."""
    worker_cls = _lookup("ray._private.worker", "Worker")
    if not getattr(worker_cls.deserialize_objects, "_rdt_batched", False):
        worker_cls.deserialize_objects = wrap(worker_cls.deserialize_objects)
    _WRAPPERS.add(worker_cls.deserialize_objects.__code__)


_WRAPPERS: Set[Any] = set()  # code objects of the functions rdt put in place of Ray's


def is_wrapper(code: Any) -> bool:
    """Whether ``code`` is a function rdt installed in place of one of Ray's (frame walks look through it)."""
    return code in _WRAPPERS


def wrap_actor_method_executor(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``FunctionActorManager._make_actor_method_executor`` by ``wrap(original)``, once per process
    (rdt._consumer.async_args)."""
    manager_cls = _lookup("ray._private.function_manager", "FunctionActorManager")
    if not getattr(manager_cls._make_actor_method_executor, "_rdt_async_args", False):
        manager_cls._make_actor_method_executor = wrap(manager_cls._make_actor_method_executor)


def current_actor_method() -> Any:
    """The class attribute of the actor method whose task this thread runs (None outside an actor task)."""
    worker = ray._private.worker.global_worker
    try:
        actor = worker.actors.get(worker.core_worker.get_actor_id())
        name = worker.core_worker.get_current_task_function_name()
    except Exception:
        return None
    if actor is None or not name:
        return None
    return getattr(type(actor), name.rpartition(".")[2], None)


def executors_of(method: Any) -> List[Any]:
    """Every executor this process's Ray made for ``method`` (one per actor class loaded that has it)."""
    infos = ray._private.worker.global_worker.function_actor_manager._function_execution_info
    return [i.function for i in list(infos.values()) if getattr(i.function, "method", None) is method]


def worker_mode() -> int:
    """This process's Ray worker mode (``ray.WORKER_MODE`` inside tasks and actors)."""
    return ray._private.worker.global_worker.mode


check()
