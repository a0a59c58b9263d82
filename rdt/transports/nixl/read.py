"""The consumer's side of a NIXL object: one-sided READs of the producer's registered buffers into fresh tensors
(each buffer keeps its kind of memory; they lie in a registered landing block, see ``landing``), into one block for
an object of many DRAM buffers, or straight into the caller's targets; a READ that times out is parked on the agent
until NIXL says it finished.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rdt_transports import _lifecycle

from ..base import Context
from ..receive import BlockViews, fresh_bytes, padded_offsets
from .agent import NixlAgent, ParkedRead, agent, release_all
from .descriptors import NixlInfo, PackedDescs, group_by_mem_type, mem_type_of

def _take_landing(ctx: "Context", ag: NixlAgent, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
    """A landing block for a READ of ``nbytes`` to ``device`` (None: register per read). Out of VRAM, the idle
    blocks on the device are given up and their memory freed here, outside the agent's lock, then it is tried
    once more; the VRAM of blocks given up meanwhile is freed here too."""
    try:
        with ag.lock:
            block = ag.landing.take(ctx, nbytes, device)
    except torch.OutOfMemoryError:
        ag.landing.retire()
        with ag.lock:
            block = ag.landing.take(ctx, nbytes, device)
    ag.landing.retire()
    return block


def _sync_pinned(block: torch.Tensor) -> None:
    """Before a READ into a CPU landing block in a process that uses CUDA: if the block is page-locked (UCX may
    register host memory with CUDA), wait for every device, where a non_blocking copy from an earlier fetch's
    tensors may still be reading it. Without CUDA initialized here, nothing can be (and nothing is asked)."""
    if torch.cuda.is_initialized() and block.is_pinned():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def _sync_cuda(bufs: List[torch.Tensor], landed: Sequence[torch.device] = ()) -> None:
    """Wait for the current stream of every CUDA device the buffers are on (NIXL moves VRAM outside streams), and
    for every stream of each device in ``landed``: a landing block is reused once the tensors of an earlier fetch
    died, whose last kernels may still run on any stream."""
    for dev in {b.device for b in bufs if b.device.type == "cuda"}:
        if dev in landed:
            torch.cuda.synchronize(dev)
        else:
            torch.cuda.current_stream(dev).synchronize()


def read_object(ctx: "Context", info: NixlInfo, device: torch.device, timeout: float,
                dests: Sequence[Optional[torch.Tensor]] = (), label: str = "an object") -> List[torch.Tensor]:
    """READ every buffer into fresh tensors on ``device`` (or into ``dests``, the caller's targets); raises
    TimeoutError, ParkedLimit or RuntimeError. ``label`` names the object in what a parked READ is marked with.

    Each buffer keeps its own kind of memory: a VRAM source is read to ``device`` when it is a CUDA device (else
    into DRAM: the consumer has no GPU), a DRAM source into CPU memory.
    """
    ag = agent(ctx)
    _check_room(ag)
    ag.ensure_remote(info.agent, info.agent_md, *info.extra_md)
    parked = False
    try:
        return _read(ctx, ag, info, device, timeout, dests, label)
    except BaseException as e:
        parked = was_parked(e)  # it stays counted as in flight until the progress thread reaps it
        raise
    finally:
        if not parked:
            ag.done_remote(info.agent)


class _Parked(TimeoutError):
    """A READ timed out but may still be moving data: its memory was parked on the agent."""


def was_parked(e: BaseException) -> bool:
    """Whether the READ that raised ``e`` was parked (timed out, or failed or interrupted while in flight): the
    progress thread then ends it, its remote agent included, once NIXL says it is over."""
    return isinstance(e, _Parked) or getattr(e, "rdt_parked", False) is True


class ParkedLimit(RuntimeError):
    """No READ was started: ``max_parked`` READs that timed out are still in flight."""


def _check_room(ag: NixlAgent) -> None:
    """Refuse to start a READ while ``max_parked`` timed-out READs are still in flight (each holds its memory)."""
    with ag.lock:
        if len(ag.parked) < ag.max_parked:
            return
        sources = sorted({p.agent for p in ag.parked})
    raise ParkedLimit(f"{len(ag.parked)} NIXL READs of this process timed out and are still in flight (from "
                      f"agents {', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''}); no new READ starts "
                      "until one ends")


def _read(ctx: "Context", ag: NixlAgent, info: NixlInfo, device: torch.device,
          timeout: float, dests: Sequence[Optional[torch.Tensor]] = (), label: str = "an object") -> List[torch.Tensor]:
    """The READ itself, into fresh tensors: a VRAM buffer on ``device``, a DRAM one in CPU memory. One transfer
    per (local, remote) memory-type pair, since a NIXL descriptor list has a single memory type."""
    if not dests and len(info.descs) > 1 and set(info.mem_types) == {"DRAM"}:
        return _read_block(ctx, ag, info, timeout)
    dst: List[Optional[torch.Tensor]] = []
    targets: List[int] = []  # the caller's tensors: registered once per storage, across fetches
    fresh: Dict[torch.device, List[int]] = {}  # per device, the buffers that land in fresh memory
    for i, ((_, n, _), t) in enumerate(zip(info.descs, info.mem_types)):
        on = device if t == "VRAM" and device.type == "cuda" else torch.device("cpu")
        given = dests[i] if i < len(dests) else None  # rdt.get(into=...): READ straight into the caller's target
        if given is not None and given.numel() == n and given.device.type == on.type:
            dst.append(given)
            targets.append(i)
        else:
            dst.append(None)
            fresh.setdefault(on, []).append(i)
    covered = set()  # buffers whose memory is registered already (landing blocks, cached targets)
    landed: List[torch.device] = []
    for on, idx in fresh.items():  # one registered landing block per device, reused once the caller drops it
        offsets, total = padded_offsets([info.descs[i][1] for i in idx])
        block = _take_landing(ctx, ag, total, on)
        if block is not None:
            landed.append(block.device)
            if block.device.type == "cpu":
                _sync_pinned(block)
        for i, o in zip(idx, offsets):
            n = info.descs[i][1]
            if block is not None:
                dst[i] = block[o:o + n]
                covered.add(i)
            else:  # too small for a block, or the bound on lent blocks is reached: registered for this READ
                dst[i] = fresh_bytes(ctx, n, on)
    bufs: List[torch.Tensor] = dst  # type: ignore[assignment]  # every slot is filled now
    _sync_cuda(bufs, landed)  # fresh VRAM may still be in use by kernels queued before this fetch
    local_types = [mem_type_of(d) for d in bufs]
    regs: List[Any] = []
    try:
        with ag.lock:
            covered.update(i for i, ok in zip(targets, ag.targets.cover([bufs[i] for i in targets])) if ok)
            for _, idx in group_by_mem_type(local_types):
                idx = [i for i in idx if i not in covered]
                if idx:
                    regs.append(ag.agent.register_memory([bufs[i] for i in idx]))
    except BaseException:
        with ag.lock:
            release_all(ag.agent, [], regs)
        raise
    plan = [([bufs[i] for i in idx], [info.descs[i] for i in idx], local_type, remote_type)
            for (local_type, remote_type), idx in group_by_mem_type(list(zip(local_types, info.mem_types)))]
    _transfer(ag, info, plan, regs, bufs, timeout, [bufs[i] for i in targets], label)
    return bufs


def _read_block(ctx: "Context", ag: NixlAgent, info: NixlInfo, timeout: float) -> Any:
    """The READ of an object of many DRAM buffers into one fresh block: one registration (none when a landing
    block takes it) and no tensor per buffer (the leaves are rebuilt from the block; see ``BlockViews``)."""
    descs = info.descs
    sizes = descs.sizes if isinstance(descs, PackedDescs) else [n for _, n, _ in descs]
    offsets, total = padded_offsets(sizes)
    cpu = torch.device("cpu")
    block = _take_landing(ctx, ag, max(total, 1), cpu)
    regs: List[Any] = []
    if block is not None:
        _sync_pinned(block)
    if block is None:  # too small for a landing block, or the lent bound is reached: registered for this READ
        block = fresh_bytes(ctx, max(total, 1), cpu)
        with ag.lock:
            regs.append(ag.agent.register_memory([block]))
    views = BlockViews(block, offsets, list(sizes), dense=bool(sizes) and total == sum(sizes))
    base = views.block.data_ptr()
    if info.packed:  # laid out as this block is: one descriptor for the whole object
        total = views.offsets[-1] + views.sizes[-1]
        local, remote = [(base, total, 0)], [(info.descs[0][0], total, 0)]
    else:
        local = [(base + o, n, 0) for o, (_, n, _) in zip(views.offsets, info.descs)]
        remote = list(info.descs)
    _transfer(ag, info, [(local, remote, "DRAM", "DRAM")], regs, [views.block], timeout)
    return views


def _park(ag: NixlAgent, info: NixlInfo, handles: List[Any], regs: List[Any], keep: List[torch.Tensor],
          targets: Sequence[torch.Tensor], label: str) -> str:
    """Keep the memory of READs that may still complete (and their handles: releasing one does not stop UCX, it
    only hides when the bytes land) until NIXL says they ended, the caller's targets marked busy meanwhile; what
    to tell the caller about its targets."""
    hold = ag.busy.mark(targets, f"the NIXL READ of {label} from {info.agent}")
    # the storages too: a caller that swaps param.data meanwhile must not free the memory the READ lands in
    held = list(keep) + [t.untyped_storage() for t in keep]
    with ag.lock:
        ag.parked.append(ParkedRead(handles, regs, held, info.agent, hold))
    return (f"; it is still in flight and may write into the {len(targets)} into= target(s) until it ends (a later "
            "rdt.get into them waits for it)") if hold is not None else ""


def _transfer(ag: NixlAgent, info: NixlInfo, plan: List[Tuple[Any, Any, str, str]], regs: List[Any],
              keep: List[torch.Tensor], timeout: float, targets: Sequence[torch.Tensor] = (),
              label: str = "an object") -> None:
    """Post one READ per (local, remote) memory-type pair of ``plan`` and wait for all (``regs``: the local
    registrations, released here with the handles; ``keep``: the local memory, parked if a READ times out;
    ``targets``: the caller's tensors among it, marked busy while a parked READ may write them)."""
    handles: List[Any] = []
    states: List[str] = []  # one per READ posted: while one may be in flight, a failure parks them
    try:
        with ag.lock:
            for local_descs, remote_descs, local_type, remote_type in plan:
                by_address = isinstance(local_descs[0], tuple)  # (address, bytes, device) rather than tensors
                local = ag.agent.get_xfer_descs(local_descs, local_type) if by_address \
                    else ag.agent.get_xfer_descs(local_descs)
                remote = ag.agent.get_xfer_descs(remote_descs, remote_type)
                handles.append(ag.agent.initialize_xfer("READ", local, remote, info.agent))
            for h in handles:
                states.append(ag.agent.transfer(h))
            if "PROC" in states:
                ag.wake_remote(info.agent)  # a producer that must progress for it (TCP) polls at full pace
        deadline = time.monotonic() + timeout
        woke = time.monotonic()
        delay = 1e-5
        while "PROC" in states:
            if time.monotonic() > deadline or _lifecycle.exiting():  # at exit: give up now, not at the deadline
                late = _park(ag, info, handles, regs, keep, targets, label)
                handles, regs, states = [], [], []
                why = "the process is exiting" if _lifecycle.exiting() else f"not done within {timeout:.1f}s"
                raise _Parked(f"NIXL READ from {info.agent}: {why}{late}")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
            with ag.lock:
                states = [ag.agent.check_xfer_state(h) if st == "PROC" else st for h, st in zip(handles, states)]
                if "PROC" in states and time.monotonic() - woke > ag.HOT_S / 2:  # a long READ keeps it awake
                    ag.wake_remote(info.agent)
                    woke = time.monotonic()
        bad = [st for st in states if st != "DONE"]
        if bad:
            raise RuntimeError(f"NIXL READ from {info.agent} failed (state {bad[0]}); the producer may have died")
    except BaseException as e:
        if "PROC" in states:  # an error or interrupt while a READ may be in flight: it may still write
            posted, handles = handles[:len(states)], handles[len(states):]
            _park(ag, info, posted, regs, keep, targets, label)
            regs = []
            try:
                e.rdt_parked = True  # type: ignore[attr-defined]  # see was_parked
            except Exception:  # noqa: BLE001 - an exception type without attributes: cannot happen for builtins
                pass
        raise
    finally:
        if handles or regs:
            with ag.lock:
                release_all(ag.agent, handles, regs)
