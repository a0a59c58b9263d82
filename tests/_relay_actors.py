"""Actors for the fan-out (relay) tests: a producer of a weight-sync-like state dict and consumers that fetch it
at an agreed wall-clock moment, so that several requests reach the producer together."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Dict, List, Tuple

import ray
import torch

import rdt

SENTINEL = 0x5A  # what a consumer writes over what it received (or its targets after an error), then re-checks


def relay_state(big: int, seed: int) -> Dict[str, torch.Tensor]:
    """A state dict of three large float32 tensors (``big`` elements each, several chunks) and 40 small ones of
    mixed dtypes (they travel packed), deterministic in ``seed``: every byte can be checked on arrival."""
    g = torch.Generator().manual_seed(seed)
    out: Dict[str, torch.Tensor] = {}
    for i in range(40):
        n = 1000 + 997 * i
        t = torch.randn(n, generator=g)
        out[f"small.{i}"] = t.to(torch.bfloat16) if i % 3 == 0 else (t * 100).to(torch.int32) if i % 3 == 1 else t
        if i % 13 == 5:
            out[f"big.{i // 13}"] = torch.randn(big, generator=g)
    out["odd"] = torch.randint(0, 255, (big // 7 + 3,), dtype=torch.uint8, generator=g)  # not a chunk multiple
    return out


def digests(value: Dict[str, torch.Tensor]) -> Dict[str, Tuple[str, Tuple[int, ...], str]]:
    """Per tensor: dtype, shape and the SHA-256 of its bytes."""
    return {k: (str(v.dtype), tuple(v.shape), hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes())
                .hexdigest()) for k, v in value.items()}


def nbytes(value: Dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in value.values())


@ray.remote(num_cpus=0)
class RelayNode:
    """Produces the state dict over gloo; consumes it with rdt.get (plain or into targets) or as an argument."""

    @rdt.tensor_method(tensor_transport="gloo")
    def state(self, big: int, seed: int) -> Dict[str, torch.Tensor]:
        return relay_state(big, seed)

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> str:
        return rdt.__file__

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a test hook (a module-level function of this file) in this actor."""
        return fn(*args)

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()

    def fetch_at(self, refs: List[Any], start: float, mode: str, timeout: float = 60.0) -> Any:
        """At wall-clock ``start``, fetch ``refs[0]`` (mode "get" or "into"); the digests, or the typed error."""
        time.sleep(max(0.0, start - time.time()))
        t0 = time.monotonic()
        try:
            if mode == "into":
                like = {k: torch.empty(s, dtype=getattr(torch, d.split(".")[-1]))
                        for k, (d, s, _) in self._shapes.items()}
                value = rdt.get(refs[0], into=like, timeout=timeout)
                assert all(value[k] is like[k] for k in like), "into: the leaves are not the targets"
            else:
                value = rdt.get(refs[0], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the test inspects the error
            return ("err", type(e).__name__, str(e), time.monotonic() - t0)
        return ("ok", digests(value), time.monotonic() - t0)

    def fetch_concurrently(self, refs: List[Any], start: float, timeout: float) -> List[Any]:
        """At wall-clock ``start``, fetch every ref of ``refs`` at once, one thread each; per ref what
        :meth:`fetch_at` returns."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(refs)) as pool:
            return list(pool.map(lambda r: self.fetch_at([r], start, "get", timeout), refs))

    def fetch_and_hold(self, refs: List[Any], start: float, mode: str, timeout: float) -> Any:
        """Like :meth:`fetch_at`, then overwrite every tensor the fetch returned, or its ``into`` targets after an
        error, with :data:`SENTINEL` bytes and keep them: :meth:`held_intact` shows whether anything wrote into
        them after the fetch returned or raised."""
        time.sleep(max(0.0, start - time.time()))
        t0 = time.monotonic()
        like: Dict[str, torch.Tensor] = {}
        try:
            if mode == "into":
                like = {k: torch.empty(s, dtype=getattr(torch, d.split(".")[-1]))
                        for k, (d, s, _) in self._shapes.items()}
                value = rdt.get(refs[0], into=like, timeout=timeout)
            else:
                value = rdt.get(refs[0], timeout=timeout)
            result: Any = ("ok", digests(value), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the test inspects the error
            value = like
            result = ("err", type(e).__name__, str(e), time.monotonic() - t0)
        for t in value.values():
            t.view(-1).view(torch.uint8).fill_(SENTINEL)
        self._held = list(value.values())
        return result

    def held_intact(self) -> bool:
        """Whether every tensor :meth:`fetch_and_hold` kept still holds only sentinel bytes."""
        return all(bool(t.view(-1).view(torch.uint8).eq(SENTINEL).all()) for t in self._held)

    def group_states(self) -> List[str]:
        """The state of every collective group this actor is in."""
        from rdt_transports._context import get_context

        return [g.state.value for g in get_context().groups() if g is not None]

    def expect(self, shapes: Dict[str, Any]) -> None:
        """The dtypes and shapes ``fetch_at(mode="into")`` allocates targets for."""
        self._shapes = shapes

    def digest_arg(self, value: Dict[str, torch.Tensor]) -> Any:
        return ("ok", digests(value), 0.0)


def hold_first_relay_post(marker: str) -> None:
    """(worker side, in a consumer) the next chained fetch posts its receives from a relay only once ``marker``
    exists (at most 30 s): the test kills that relay first, so the receives are posted to a peer already gone."""
    from rdt.transports.group import transport as group_transport

    cls = group_transport._RelayReceive
    original = cls._phase

    def held(self: Any, source: int, tag_base: int, first: int) -> Any:
        if source != self.ref.rank:
            cls._phase = original
            end = time.monotonic() + 30.0
            while not os.path.exists(marker) and time.monotonic() < end:
                time.sleep(0.01)
        return original(self, source, tag_base, first)

    cls._phase = held


def relay_chains() -> List[Tuple[int, str, str, List[int]]]:
    """(in a producer) Its relay chains: (chain id, object id hex, group uid, member ranks)."""
    from rdt._process.context import get_context
    from rdt.transports.group import relay as _relay

    table = _relay.table(get_context())
    with table._cond:
        return [(cid, c.key[0].hex(), c.key[1], list(c.members)) for cid, c in table._chains.items()]


def control_address() -> str:
    """(in a producer) Its control server's address."""
    from rdt._process.context import get_context

    return get_context().producer_info().control_address


def poll_relay_chain(address: str, obj_hex: str, group_uid: str, rank: int, cid: int, final: int) -> Tuple[Any, ...]:
    """(in a member of the group ``group_uid``) Ask the producer at ``address`` whom ``rank`` of chain ``cid``
    forwards ``obj_hex`` to, as a chained consumer does, signed with that group's secret (``final``: and close
    it); ("ok", follower rank) or ("err", error code, text)."""
    import struct

    from rdt._control import wire as _control
    from rdt._process.context import get_context
    from rdt.transports.group import relay as _relay
    from rdt.transports.group.protocol import REQ_RELAY_NEXT
    from rdt_transports._context import get_context as transport_context

    group = next(g for g in transport_context().groups() if g is not None and g.uid == group_uid)
    payload = bytes.fromhex(obj_hex) + bytes.fromhex(group_uid) + struct.pack(_relay.NEXT_REQUEST, rank, cid, 200,
                                                                              final)
    resp_type, resp = get_context().client.request(address, REQ_RELAY_NEXT, _control.KEY_GROUP,
                                                   group.backend.config.secret, payload, 10.0)
    if resp_type == _control.RESP_OK:
        return ("ok", struct.unpack(_relay.NEXT_REPLY, resp)[0])
    return ("err", struct.unpack_from("!H", resp)[0], resp[2:].decode(errors="replace"))
