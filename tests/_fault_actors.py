"""Actors and helpers shared by the fault, chaos, multi-node and load tests.

``Peer`` is a producer and consumer at once: ``make_<transport>(seed, nbytes)`` returns a uint8 tensor filled
with a pattern derived from ``seed`` (so any process can recompute what it must hold), ``digest(value)``
returns the seed and a checksum of what arrived. ``call(fn, ...)`` runs a module-level helper inside the actor
and returns ``(Caught or None, value, seconds)`` so tests can inspect worker-side errors and state.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

TRANSPORTS = ("gloo", "shm", "nixl", "auto")


# ---------------------------------------------------------------------------------------------- payloads
def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 that depend on ``seed`` and on the position (a swapped or shifted block shows).

    Built from one 64 KiB block plus a per-block offset, so it costs ~nbytes of memory, whatever the size."""
    block = 1 << 16
    idx = torch.arange(block, dtype=torch.int64)
    base = ((idx * (2 * seed + 1) + (idx >> 8) * 131 + seed * 7) % 251).to(torch.uint8)
    rows = max((nbytes + block - 1) // block, 1)
    out = base.view(1, -1).repeat(rows, 1)
    out += ((torch.arange(rows, dtype=torch.int64) * 17 + seed) % 251).to(torch.uint8).view(-1, 1)
    return out.view(-1)[:nbytes].clone() if rows * block != nbytes else out.view(-1)


def checksum(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


_expected: Dict[Tuple[int, int], str] = {}


def expected_checksum(seed: int, nbytes: int) -> str:
    key = (seed, nbytes)
    if key not in _expected:
        _expected[key] = checksum(pattern(seed, nbytes))
    return _expected[key]


class Caught:
    """An exception caught in a worker, carried to the driver as class, message and rdt attributes."""

    def __init__(self, exc: BaseException) -> None:
        self.cls = type(exc)
        self.message = str(exc)
        self.attrs = {k: getattr(exc, k, None) for k in ("group", "rank", "peer", "op", "hint", "dead_ranks")}

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({self.message!r})"


def _maker(transport: str):
    @rdt.tensor_method(tensor_transport=transport)
    def make(self, seed: int, nbytes: int, chunks: int = 1) -> Dict[str, Any]:
        if chunks == 1:
            return {"t": pattern(seed, nbytes), "seed": seed}
        per = nbytes // chunks
        return {"parts": [pattern(seed + i, per) for i in range(chunks)], "seed": seed}

    return make


@ray.remote(num_cpus=0)
class Peer:
    """Producer and consumer at once; see the module docstring."""

    make_gloo = _maker("gloo")
    make_shm = _maker("shm")
    make_nixl = _maker("nixl")
    make_auto = _maker("auto")
    make_object_store = _maker("object_store")

    def __init__(self) -> None:
        self.held: List[Any] = []

    @rdt.tensor_method(tensor_transport="gloo")
    def make_late(self, seed: int, nbytes: int, delay: float) -> Dict[str, Any]:
        time.sleep(delay)  # the producer is killed before it returns: the object never exists
        return {"t": pattern(seed, nbytes), "seed": seed}

    def ping(self) -> int:
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Tuple[Optional[Caught], Any, float]:
        t0 = time.monotonic()
        try:
            value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return Caught(e), None, time.monotonic() - t0
        return None, value, time.monotonic() - t0

    # ---- consumer side
    def digest(self, value: Any) -> Tuple[int, str]:
        if "parts" in value:
            return value["seed"], "".join(checksum(p) for p in value["parts"])
        return value["seed"], checksum(value["t"])

    def digest_many(self, values: List[Any]) -> List[Tuple[int, str]]:
        """Digests of refs passed nested in a list (fetched here with ray.get)."""
        return [self.digest(v) for v in ray.get(values)]

    def try_digest(self, refs: List[Any], timeout: float = 120.0) -> Tuple[str, Any, float]:
        """Fetch ``refs[0]`` here; ("ok", digest, s) or ("err", Caught, s): the error type survives as data."""
        t0 = time.monotonic()
        try:
            return "ok", self.digest(ray.get(refs[0], timeout=timeout)), time.monotonic() - t0
        except Exception as e:  # noqa: BLE001
            return "err", Caught(e), time.monotonic() - t0

    def hold(self, refs: List[Any]) -> None:
        self.held.extend(refs)

    def release(self) -> None:
        self.held.clear()


# ---------------------------------------------------------------------------------------------- worker side
def table_state() -> Dict[str, int]:
    """(worker side) objects held and how many of them carry a NIXL registration."""
    from rdt._process.context import get_context

    entries = get_context().table.entries()
    return {"objects": len(entries), "nixl": sum(1 for e in entries if e.exports.get("nixl") is not None),
            "shm": sum(1 for e in entries if e.exports.get("shm") is not None)}


def control_address() -> Optional[str]:
    """(worker side) this process's rdt control server address, starting it if needed."""
    from rdt._process.context import get_context

    return get_context().producer_info().control_address


def reap() -> int:
    """(worker side) one tick of the shm reaper every rdt process runs every 30 s."""
    from rdt.transports.shm import segments as _shm

    return _shm.reap_dead_owners()


def group_state(name: str) -> Optional[str]:
    import rdt_transports as rt

    return rt.get_group(name).state.value if rt.is_group_initialized(name) else None


def dead_ranks(name: str) -> List[int]:
    """(worker side) the ranks of group ``name`` that Ray reports dead, as this member sees them."""
    import rdt_transports as rt

    return rt.get_group(name).dead_ranks()


def allreduce(name: str, value: float, timeout: float = 20.0, n: int = 4) -> List[float]:
    import rdt_transports as rt

    t = torch.full((n,), float(value))
    rt.allreduce(t, name, timeout=timeout)
    return t.tolist()


def hook_next_send(marker: str, stop_after_s: float = 0.0, freeze: bool = True) -> None:
    """(worker side, in a producer) after the next group fetch has posted its sends, wait ``stop_after_s``, touch
    ``marker`` and (``freeze``) SIGSTOP this whole process, so a test can kill it while the transfer is in flight."""
    from rdt._process.context import get_context

    ctx = get_context()
    original = ctx._server._handlers[1]  # REQ_FETCH_GROUP

    def hooked(key_id: int, payload: bytes) -> Any:
        out = original(key_id, payload)

        def stop() -> None:
            time.sleep(stop_after_s)
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            if freeze:
                os.kill(os.getpid(), signal.SIGSTOP)

        threading.Thread(target=stop, daemon=True).start()
        ctx._server._handlers[1] = original
        return out

    ctx._server._handlers[1] = hooked


# ---------------------------------------------------------------------------------------------- driver side
def stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def pid_gone(pid: int) -> bool:
    from rdt_transports._proc import pid_alive

    return not pid_alive(pid)


def shm_of(pid: int) -> List[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rdt-{pid}-")]


def refused(address: str, timeout: float = 2.0) -> bool:
    """True when nothing listens at ``address`` any more (the dead process's control socket is closed)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def actor_dead(actor: Any) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=2)
        return False
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False
