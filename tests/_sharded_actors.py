"""Actors for tests/test_sharded.py: trainer ranks holding Shard(0) of a few parameters, consumer ranks with
column-parallel, row-parallel and fused-qkv wants. Both sides build the full parameters the same way (seeded by
name and version), so the driver can compare every landed byte against the narrowed full tensor."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import ray
import torch

import rdt

H = 2048  # wide enough that each rank's shards (~110 KB) are held, not carried inline in the metadata
# "embed": a vocabulary-parallel table whose slices (>= 80 KB a rank) cross gloo in messages of their own (DIRECT_MIN)
SHAPES: Dict[str, Tuple[int, ...]] = {"q": (12, H), "k": (6, H), "v": (6, H), "o": (8, 1536), "gate": (10, H),
                                      "embed": (64, H), "norm": (H,)}
REPLICATED = ("norm",)


def full(name: str, version: int) -> torch.Tensor:
    """Parameter ``name`` of ``version`` whole: distinct values everywhere, changed by every version."""
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 7)
    return torch.randn(SHAPES[name], generator=g) + version


def splits(n: int, world: int) -> List[int]:
    """torch.chunk's sizes (uneven last shards, as DTensor's Shard(0))."""
    return [c.shape[0] for c in torch.arange(n).chunk(world)]


def rows_of(name: str, rank: int, world: int, sizes: Optional[Sequence[int]] = None, dim: int = 0
            ) -> Tuple[int, int]:
    """[lo, hi) of ``name`` along ``dim`` that rank ``rank`` of ``world`` holds."""
    sizes = list(sizes) if sizes is not None else splits(SHAPES[name][dim], world)
    start = sum(sizes[:rank])
    return start, start + (sizes[rank] if rank < len(sizes) else 0)


def layouts(rank: int, world: int, dims: Optional[Dict[str, int]] = None,
            sizes: Optional[Dict[str, Optional[List[int]]]] = None) -> Dict[str, rdt.Layout]:
    """Where rank ``rank`` of ``world``'s piece of every parameter sits: whole for the replicated ones, else its rows
    along ``dims[name]`` (0 by default), of ``sizes[name]`` (even splits by default)."""
    dims, sizes = dims or {}, sizes or {}
    out = {}
    for name in SHAPES:
        if name in REPLICATED:
            out[name] = rdt.Layout.whole(SHAPES[name])
        else:
            d = dims.get(name, 0)
            lo, _ = rows_of(name, rank, world, sizes.get(name), d)
            start = [0] * len(SHAPES[name])
            start[d] = lo
            out[name] = rdt.Layout(SHAPES[name], tuple(start))
    return out


@ray.remote(num_cpus=0)
class Trainer:
    """Rank ``rank`` of ``world``: holds rows of every parameter (plain tensors with a layout, or DTensors)."""

    def __init__(self, rank: int, world: int, dtensor_port: int = 0, dims: Optional[Dict[str, int]] = None) -> None:
        self.rank, self.world = rank, world
        self.dims = dict(dims or {})  # Shard(d) per parameter (default Shard(0))
        self.sizes: Dict[str, Optional[List[int]]] = {n: None for n in SHAPES}
        self.mesh = None
        if dtensor_port:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dtensor_port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
            self.mesh = init_device_mesh("cpu", (world,))
        self.version = 0
        self.published: Optional[rdt.Shards] = None
        self._build()

    def _build(self) -> None:
        self.local: Dict[str, torch.Tensor] = {}
        for name in SHAPES:
            t = full(name, self.version)
            if name not in REPLICATED:
                d = self.dims.get(name, 0)
                lo, hi = rows_of(name, self.rank, self.world, self.sizes[name], d)
                t = t.narrow(d, lo, hi - lo).contiguous().clone()
            self.local[name] = t

    def file(self) -> str:
        return rdt.__file__

    def pid(self) -> int:
        return os.getpid()

    def step(self) -> None:
        """The optimizer's in-place update: every parameter moves to the next version's values."""
        self.version += 1
        for name, t in self.local.items():  # exactly full(name, version)'s bytes: x + 1 + 1 may round off x + 2
            new = full(name, self.version)
            if name not in REPLICATED:
                d = self.dims.get(name, 0)
                lo, hi = rows_of(name, self.rank, self.world, self.sizes[name], d)
                new = new.narrow(d, lo, hi - lo)
            t.copy_(new)

    def step_publish(self, transport: str = "shm", keep_versions: int = 0) -> rdt.Shards:
        """``step`` then ``publish``: one call where a test drives many versions."""
        self.step()
        return self.publish(transport, keep_versions)

    def set_version(self, version: int) -> None:
        """Hold ``version``'s weights (a spare taking a killed rank's place)."""
        self.version = version
        self._build()

    def fence_step(self, timeout: float) -> None:
        """Fence the live publication (its readers waited for at most ``timeout``), then update in place."""
        if self.published is not None:
            try:
                self.published.fence(timeout=timeout)
            except rdt.FenceTimeoutError:
                pass  # the version is gone all the same: its readers fail rather than return these updates
        self.step()

    def reshard(self, name: str, sizes: List[int]) -> None:
        """Change how ``name`` is split across the ranks (a changed layout)."""
        self.sizes[name] = sizes
        self._build()

    def state(self) -> Dict[str, Any]:
        if self.mesh is None:
            return dict(self.local)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        out = {}
        for name, t in self.local.items():
            shape = SHAPES[name]
            stride = torch.empty(shape).stride()
            place = [Replicate()] if name in REPLICATED else [Shard(self.dims.get(name, 0))]
            out[name] = DTensor.from_local(t, self.mesh, place, run_check=False, shape=torch.Size(shape),
                                           stride=stride)
        return out

    def layouts(self) -> Dict[str, rdt.Layout]:
        return layouts(self.rank, self.world, self.dims, self.sizes)

    def publish(self, transport: str = "shm", keep_versions: int = 0) -> rdt.Shards:
        """Publish this rank's shards as the current version (kept here, as a trainer keeps them to fence them)."""
        if self.mesh is not None:
            self.published = rdt.put_shards(self.state(), version=self.version, tensor_transport=transport,
                                            keep_versions=keep_versions)
        else:
            self.published = rdt.put_shards(self.state(), version=self.version, layouts=self.layouts(),
                                            rank=self.rank, tensor_transport=transport, keep_versions=keep_versions)
        return self.published

    def hold_send_threads(self, seconds: float) -> None:
        """Keep every thread this process waits on object sends with busy for ``seconds`` (a stalled producer)."""
        import threading

        from rdt._process.context import SEND_WAITERS, get_context

        gate = threading.Barrier(SEND_WAITERS + 1)
        for _ in range(SEND_WAITERS):
            get_context().send_waiters.submit(lambda: (gate.wait(), time.sleep(seconds)))
        gate.wait(10.0)

    @rdt.tensor_method(tensor_transport="shm")
    def dtensor_state(self) -> Dict[str, Any]:
        return self.state()


@contextlib.contextmanager
def delayed_reads(transport: str, obj_id: bytes, seconds: float) -> Iterator[None]:
    """In this process: range reads of object ``obj_id`` over ``transport`` (any of auto's for "auto") start
    ``seconds`` late (the bytes then move for real), so that a test can act while that read is in flight."""
    chain = rdt.transports.auto_chain() if transport == "auto" else [rdt.transports.get(transport)]

    def delayed(t: Any) -> Any:
        inner = type(t).read_ranges

        def read_ranges(ctx: Any, meta: Any, *rest: Any) -> Any:
            if meta.obj_id == obj_id:
                time.sleep(seconds)
            return inner(t, ctx, meta, *rest)

        return read_ranges

    for t in chain:
        t.read_ranges = delayed(t)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for t in chain:
            del t.read_ranges


def wants(rank: int, tp: int) -> List[Tuple[str, List[Tuple[str, int, int, int]], int, str]]:
    """Tensor-parallel rank ``rank`` of ``tp``: (target, [(param, dim, start, length)], cat dim, dtype)."""
    q, k, o_cols, gate = SHAPES["q"][0] // tp, SHAPES["k"][0] // tp, SHAPES["o"][1] // tp, SHAPES["gate"][0] // tp
    vocab = SHAPES["embed"][0] // tp
    return [
        ("qkv", [("q", 0, rank * q, q), ("k", 0, rank * k, k), ("v", 0, rank * k, k)], 0, "float32"),  # fused
        ("o", [("o", 1, rank * o_cols, o_cols)], 0, "float32"),  # row-parallel: a strided slice
        ("gate", [("gate", 0, rank * gate, gate)], 0, "float32"),  # column-parallel, across uneven shards
        ("gate_bf16", [("gate", 0, rank * gate, gate)], 0, "bfloat16"),  # the same with a cast
        ("embed", [("embed", 0, rank * vocab, vocab)], 0, "float32"),  # vocabulary-parallel
        ("norm", [("norm", -1, 0, -1)], 0, "float32"),  # replicated, whole
    ]


def expected(rank: int, tp: int, version: int) -> Dict[str, torch.Tensor]:
    out = {}
    for target, regions, dim, dtype in wants(rank, tp):
        parts = [full(p, version) if d < 0 else full(p, version).narrow(d, s, n) for p, d, s, n in regions]
        out[target] = torch.cat(parts, dim).to(getattr(torch, dtype))
    return out


@ray.remote(num_cpus=0)
class Consumer:
    """An engine rank: its targets, and a loader that fills them."""

    def __init__(self, rank: int, tp: int) -> None:
        self.rank, self.tp = rank, tp
        self.reset()

    def reset(self) -> None:
        """A new loader with fresh targets (what a new actor would have, without starting one)."""
        rank, tp = self.rank, self.tp
        self.loader = rdt.WeightLoader()
        self.targets: Dict[str, torch.Tensor] = {}
        ref = expected(rank, tp, 0)
        for target, regions, dim, dtype in wants(rank, tp):
            t = self.targets[target] = torch.full(ref[target].shape, -1.0, dtype=getattr(torch, dtype))
            regs = [rdt.Region(p) if d < 0 else rdt.Region(p, d, s, n) for p, d, s, n in regions]
            self.loader.want(t, regs, dim=dim, cast=dtype != "float32", name=target)

    def load(self, source: Any, timeout: float = 30.0, verify: bool = False) -> Dict[str, Any]:
        """Load a manifest (from the trainers) or a replica (from another consumer with the same wants)."""
        report = self.loader.load(source, timeout=timeout, verify=verify)
        return {"report": report, "targets": {k: v.clone() for k, v in self.targets.items()},
                "plans": self.loader.plans, "replays": self.loader.replays,
                "target_bytes": sum(v.nbytes if v.dtype == torch.float32 else v.numel() * 4
                                    for v in self.targets.values())}

    def load_newest(self, trainers: List[Any]) -> Dict[str, Any]:
        """Ask the trainer actors for their newest version, then load it."""
        return self.load(rdt.Manifest.newest(trainers, timeout=10.0))

    def configure(self, **kwargs: Any) -> None:
        rdt.configure(**kwargs)

    def share(self, transport: str = "auto") -> rdt.Replica:
        return self.loader.share(tensor_transport=transport)

    def try_load(self, source: Any, timeout: float = 30.0) -> str:
        """The error a load raises (its type and message), or "ok"."""
        try:
            self.loader.load(source, timeout=timeout)
        except rdt.RdtError as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    def load_outcomes(self, source: Any, times: int) -> List[Tuple[str, Optional[Dict[str, torch.Tensor]]]]:
        """``times`` loads of ``source`` one after another: ("ok", the targets) or (the error's type, None)."""
        out: List[Tuple[str, Optional[Dict[str, torch.Tensor]]]] = []
        for _ in range(times):
            try:
                self.loader.load(source, timeout=30.0)
                out.append(("ok", self.targets_now()))
            except rdt.RdtError as e:
                out.append((type(e).__name__, None))
        return out

    def targets_now(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.targets.items()}

    def swap_target_data(self, name: str, dtype: str) -> None:
        """``param.data = param.data.to(dtype)``: the same tensor object, another dtype and size, new storage."""
        t = self.targets[name]
        t.data = t.data.to(getattr(torch, dtype))

    def move_targets(self) -> None:
        """Every target onto new storage (same tensor objects, new data pointers), filled with -1."""
        for t in self.targets.values():
            t.set_(torch.full_like(t, -1.0))

    def swap_target(self, name: str, how: str) -> None:
        """Change target ``name`` at the same byte count: "dtype" (float32 bytes seen as int32) or "shape" (the
        same storage viewed transposed): ``param.data = ...`` as a model surgery might."""
        t = self.targets[name]
        t.data = t.data.view(torch.int32) if how == "dtype" else t.data.view(t.shape[::-1])

    def want_more(self, name: str, param: str) -> None:
        """Want one more target (fresh, filled with -1) receiving ``param`` whole."""
        t = self.targets[name] = torch.full(SHAPES[param], -1.0)
        self.loader.want(t, rdt.Region(param), name=name)

    def interrupted_load(self, slow: Any, fast: Any, transport: str, delay: float, after: float,
                         exc: str = "KeyboardInterrupt") -> Dict[str, Any]:
        """Load ``slow`` with the read of its rank 1 delayed ``delay`` s, interrupted after ``after`` s by ``exc``
        raised in this, the loading, thread (as Ctrl-C raises KeyboardInterrupt; Ray keeps SIGINT blocked in
        actors, so SIGUSR1's handler raises it); then load ``fast``. Returns how each ended and when, whether the
        targets changed in the second after the first failed, and the targets right after the second and
        ``delay`` s later."""
        import signal
        import threading

        error = KeyboardInterrupt if exc == "KeyboardInterrupt" else RuntimeError

        def interrupt(_sig: int, _frame: Any) -> None:
            raise error("injected into the loading thread")

        old = signal.signal(signal.SIGUSR1, interrupt)
        main = threading.main_thread().ident
        timer = threading.Timer(after, lambda: signal.pthread_kill(main, signal.SIGUSR1))
        out: Dict[str, Any] = {}
        with delayed_reads(transport, slow.shards[1].meta.obj_id, delay):
            t0 = time.monotonic()
            timer.start()
            try:
                self.loader.load(slow, timeout=30.0)
                out["first"] = "ok"
            except BaseException as e:  # noqa: BLE001 - what the injected exception did
                out["first"] = type(e).__name__
            finally:
                out["first_s"] = time.monotonic() - t0
                timer.cancel()
                signal.signal(signal.SIGUSR1, old)
        failed = self.targets_now()
        time.sleep(1.0)
        out["changed_after_failure"] = any(not torch.equal(v.view(torch.uint8), failed[k].view(torch.uint8))
                                           for k, v in self.targets_now().items())
        try:
            self.loader.load(fast, timeout=30.0)
            out["second"] = "ok"
        except rdt.RdtError as e:
            out["second"] = f"{type(e).__name__}: {e}"
        out["right_after"] = self.targets_now()
        time.sleep(delay + 0.5)
        out["later"] = self.targets_now()
        return out

    def cancelled_async_load(self, slow: Any, fast: Any, delay: float, after: float) -> Dict[str, Any]:
        """Cancel an async load of ``slow`` (its rank 1 read delayed ``delay`` s) ``after`` s in, then load
        ``fast`` at once: how each ended, how long the second took, and the targets right after it and later."""
        import asyncio

        async def abandon() -> str:
            task = asyncio.ensure_future(self.loader.load_async(slow, timeout=30.0))
            await asyncio.sleep(after)
            running = not task.done()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled while running" if running else "cancelled"
            return "ok"

        out: Dict[str, Any] = {}
        loop = asyncio.new_event_loop()  # not asyncio.run: it would wait for the executor's load at its end
        try:
            with delayed_reads("shm", slow.shards[1].meta.obj_id, delay):
                out["first"] = loop.run_until_complete(abandon())
                t0 = time.monotonic()
                self.loader.load(fast, timeout=30.0)
                out["second_s"] = time.monotonic() - t0
        finally:
            loop.close()
        out["right_after"] = self.targets_now()
        time.sleep(delay + 0.5)
        out["later"] = self.targets_now()
        return out

    def share_during_load(self, source: Any, delay: float, after: float) -> Dict[str, Any]:
        """Call share() from another thread ``after`` s into a load of ``source`` whose rank 1 read is delayed
        ``delay`` s: what share() gave (the replica's version, or its error) and whether the load had ended."""
        import threading

        got: Dict[str, Any] = {}
        done = threading.Event()

        def share() -> None:
            time.sleep(after)
            try:
                got["version"] = self.loader.share().version
            except rdt.RdtError as e:
                got["error"] = f"{type(e).__name__}: {e}"
            got["load_ended"] = done.is_set()

        sharer = threading.Thread(target=share)
        with delayed_reads("shm", source.shards[1].meta.obj_id, delay):
            sharer.start()
            self.loader.load(source, timeout=30.0)
            done.set()
        sharer.join(30.0)
        return got

    def reader_threads(self) -> List[int]:
        """The OS thread ids of the range road's reading threads alive now."""
        import threading

        return sorted(t.native_id for t in threading.enumerate() if t.name.startswith("rdt-ranges"))
