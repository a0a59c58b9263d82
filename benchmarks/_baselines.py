"""Baselines measured in the same run: ray.util.collective Gloo, raw torch.distributed Gloo, and the object store."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
from datetime import timedelta
from typing import Any, Dict, List, Optional

import numpy as np
import ray

from ._collectives import BenchContext, Impl, gather_times, make_tensor, timed_loop


# ---------------------------------------------------------------------- ray.util.collective (Gloo)
def _rayc_init(self: Any, world_size: int, rank: int, group: str, timeout_ms: int) -> int:
    """In an actor: join a ray.util.collective Gloo group."""
    import ray.util.collective as col

    col.init_collective_group(world_size, rank, backend="gloo", group_name=group, gloo_timeout=timeout_ms)
    return rank


def _rayc_destroy(self: Any, group: str) -> None:
    """In an actor: leave the ray.util.collective group."""
    import ray.util.collective as col

    col.destroy_collective_group(group)


def _rayc_measure(self: Any, group: str, rank: int, world_size: int, op: str, nbytes: int, warmup: int,
                  iters: int) -> List[float]:
    """In an actor: time ray.util.collective send/recv or allreduce."""
    import ray.util.collective as col

    t = make_tensor(self.state, nbytes)
    if op == "p2p":
        run = (lambda: col.send(t, 1, group)) if rank == 0 else (lambda: col.recv(t, 0, group)) if rank == 1 \
            else (lambda: None)
    else:
        run = lambda: col.allreduce(t, group)  # noqa: E731
    return timed_loop(lambda: col.barrier(group), run, t, op, rank, world_size, warmup, iters)


class RayCollectiveImpl(Impl):
    """ray.util.collective with backend="gloo" (torch.distributed Gloo under it in Ray 2.60)."""

    name = "ray.collective-gloo"
    family = "baseline"
    backend = "gloo"
    static_mechanism = "gloo"

    def __init__(self) -> None:
        self._group: Optional[str] = None
        self._actors: List[Any] = []

    def setup(self, ctx: BenchContext, world_size: int) -> None:
        """Every actor joins a fresh group."""
        self._actors = ctx.pool.get(world_size)
        group = ctx.group_name("rayc")
        timeout_ms = int(ctx.config.group_timeout * 1000)
        refs = [a.__ray_call__.remote(_rayc_init, world_size, r, group, timeout_ms) for r, a in enumerate(self._actors)]
        try:
            ray.get(refs, timeout=ctx.config.group_timeout + 30)
        except ray.exceptions.GetTimeoutError:
            ctx.pool.reset()
            raise
        self._group = group

    def measure(self, ctx: BenchContext, op: str, nbytes: int, warmup: int, iters: int) -> List[List[float]]:
        """Run the timed loop on every member."""
        n = len(self._actors)
        refs = [a.__ray_call__.remote(_rayc_measure, self._group, r, n, op, nbytes, warmup, iters)
                for r, a in enumerate(self._actors)]
        return gather_times(ctx, refs, nbytes)

    def teardown(self, ctx: BenchContext) -> None:
        """Destroy the group (its torch subgroup; the process-wide default group stays, as Ray keeps it)."""
        if self._group is not None and ctx.pool.actors is self._actors:
            ray.get([a.__ray_call__.remote(_rayc_destroy, self._group) for a in self._actors], timeout=30)
        self._group = None


# ---------------------------------------------------------------------- object store ("assembled")
def _objstore_measure(self: Any, mailbox: Any, key: str, rank: int, world_size: int, op: str, nbytes: int,
                      warmup: int, iters: int, timeout: float, zero_copy: bool) -> List[float]:
    """In an actor: p2p = rank 0 ray.put()s, rank 1 ray.get()s; allreduce = everybody puts, gets all, sums.

    ``zero_copy`` puts ``tensor.numpy()`` (read back zero-copy from shared memory) instead of the torch tensor
    (which Ray pickles, i.e. copies, on put and on get).
    """
    t = make_tensor(self.state, nbytes)
    step = [0]

    def exchange(value: Any) -> List[Any]:
        step[0] += 1
        return ray.get(mailbox.exchange.remote(f"{key}/{step[0]}", rank, value, world_size, timeout), timeout=timeout)

    def put() -> List[Any]:
        return [ray.put(t.numpy() if zero_copy else t)]

    def run() -> None:
        if op == "p2p":
            refs = exchange(put() if rank == 0 else None)
            if rank == 1:
                got = ray.get(refs[0][0], timeout=timeout)
                if zero_copy:
                    t.numpy()[:] = got
                else:
                    t.copy_(got)
            return
        parts = ray.get([r[0] for r in exchange(put())], timeout=timeout)
        if zero_copy:
            out = t.numpy()
            np.add(parts[0], parts[1], out=out) if len(parts) > 1 else np.copyto(out, parts[0])
            for p in parts[2:]:
                np.add(out, p, out=out)
            return
        acc = parts[0].clone()
        for p in parts[1:]:
            acc += p
        t.copy_(acc)

    return timed_loop(lambda: exchange(None), run, t, op, rank, world_size, warmup, iters)


class ObjectStoreImpl(Impl):
    """The 'assembled' baseline: tensors through Ray's object store, refs exchanged through a mailbox actor."""

    family = "baseline"
    backend = "objstore"
    static_mechanism = "object_store"

    def __init__(self, zero_copy: bool = False) -> None:
        self.zero_copy = zero_copy
        self.name = "ray-objstore-numpy" if zero_copy else "ray-objstore"
        self._actors: List[Any] = []
        self._key = ""

    def setup(self, ctx: BenchContext, world_size: int) -> None:
        """Use the pool's actors and the mailbox."""
        self._actors = ctx.pool.get(world_size)
        self._key = ctx.group_name("objstore")

    def measure(self, ctx: BenchContext, op: str, nbytes: int, warmup: int, iters: int) -> List[List[float]]:
        """Run the timed loop on every member."""
        mailbox = ctx.pool.get_mailbox()
        n = len(self._actors)
        key = f"{self._key}/{op}/{nbytes}"
        timeout = ctx.config.op_timeout(nbytes)
        refs = [a.__ray_call__.remote(_objstore_measure, mailbox, key, r, n, op, nbytes, warmup, iters, timeout,
                                      self.zero_copy)
                for r, a in enumerate(self._actors)]
        return gather_times(ctx, refs, nbytes)


# ---------------------------------------------------------------------- raw torch.distributed (no Ray)
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_worker(rank: int, world_size: int, port: int, timeout: float, commands: Any, results: Any) -> None:
    """A plain process: join a Gloo process group through a TCPStore, then serve measurement commands."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the store and the pairs are on 127.0.0.1
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        results.put((rank, "ready", None))
    except Exception as e:  # noqa: BLE001
        results.put((rank, "error", f"{type(e).__name__}: {e}"))
        return
    state: Dict[Any, Any] = {}
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        op, nbytes, warmup, iters = cmd
        try:
            t = make_tensor(state, nbytes)
            if op == "p2p":
                run = (lambda: dist.send(t, 1)) if rank == 0 else (lambda: dist.recv(t, 0)) if rank == 1 \
                    else (lambda: None)
            else:
                run = lambda: dist.all_reduce(t)  # noqa: E731
            results.put((rank, "ok", timed_loop(dist.barrier, run, t, op, rank, world_size, warmup, iters)))
        except Exception as e:  # noqa: BLE001
            results.put((rank, "error", f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


class TorchDistImpl(Impl):
    """torch.distributed Gloo in plain spawned processes with a TCPStore on 127.0.0.1 (no Ray involved)."""

    name = "torch.dist-gloo"
    family = "baseline"
    backend = "gloo"
    static_mechanism = "gloo"

    def __init__(self) -> None:
        self._procs: List[Any] = []
        self._commands: List[Any] = []
        self._results: Any = None
        self._broken = False

    def setup(self, ctx: BenchContext, world_size: int) -> None:
        """Spawn ``world_size`` processes and wait until their process group is up."""
        mp_ctx = mp.get_context("spawn")
        self._results = mp_ctx.Queue()
        self._commands = [mp_ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._broken = False
        self._procs = [mp_ctx.Process(target=_torch_worker, daemon=True,
                                      args=(r, world_size, port, ctx.config.group_timeout, self._commands[r],
                                            self._results)) for r in range(world_size)]
        for p in self._procs:
            p.start()
        try:
            self._collect(world_size, ctx.config.group_timeout + 60)
        except Exception:
            self.teardown(ctx)
            raise

    def _collect(self, n: int, timeout: float) -> List[Any]:
        out: List[Any] = [None] * n
        for _ in range(n):
            try:
                rank, status, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self._broken = True
                raise TimeoutError(f"torch.distributed workers gave no answer within {timeout:.0f}s") from None
            if status == "error":
                self._broken = True  # other ranks' answers may still be queued: stop using these processes
                raise RuntimeError(f"rank {rank}: {value}")
            out[rank] = value
        return out

    def measure(self, ctx: BenchContext, op: str, nbytes: int, warmup: int, iters: int) -> List[List[float]]:
        """Send the command to every process and collect the per-rank timings."""
        if self._broken:
            raise RuntimeError("skipped: an earlier size failed in these processes")
        for q in self._commands:
            q.put((op, nbytes, warmup, iters))
        return self._collect(len(self._procs), ctx.config.call_timeout(nbytes))

    def teardown(self, ctx: BenchContext) -> None:
        """Stop the processes (killing any that does not exit)."""
        for q in self._commands:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._commands, self._results = [], [], None


def baseline_impls(op: str) -> List[Impl]:
    """The baselines for ``op`` (fresh objects: they hold per-case state)."""
    return [RayCollectiveImpl(), TorchDistImpl(), ObjectStoreImpl(), ObjectStoreImpl(zero_copy=True)]
