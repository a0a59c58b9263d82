"""The weight-sync suite's actor: a trainer that publishes its bf16 state dict every step by each mechanism, or a
worker that loads it into its own preallocated parameters and checks the trainer's marker value.

One class plays both roles so that the trainer and the workers can be in the same groups. Peak resident memory is
the kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` when sampling starts). Private
memory (USS) is read from ``/proc/self/smaps_rollup`` at the start and end and, while a sync runs, sampled at a
pace that keeps those reads under a twentieth of a core (one costs 3-10 ms of CPU in a process that imported torch:
sampled every 3 ms, as before, each actor's sampler took a whole core and slowed the step it measured); between
them, private anonymous memory (``RssAnon`` of /proc/self/status, 40 us a read) is sampled every 3 ms, so a fresh
buffer that lives a few milliseconds still counts in the USS peak.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
import torch

import rdt

Shape = Tuple[int, ...]
PAGE_FLOATS = 1024
SAMPLE_S = 0.003  # private anonymous memory (RssAnon) read this often while sampling
SAMPLER_CPU_SHARE = 0.05  # smaps_rollup's reads cost at most this share of a core: next read >= its cost / share


class WrongMarkerError(AssertionError):
    """A worker's parameters do not hold the marker the trainer published: the sync moved the wrong data."""


def read_memory() -> Dict[str, int]:
    """This process's resident memory and private memory (USS: Private_Clean + Private_Dirty + Private_Hugetlb)."""
    fields: Dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Private_Clean", "Private_Dirty", "Private_Hugetlb"):
                fields[key] = int(rest.split()[0]) * 1024
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0) + fields.get("Private_Hugetlb", 0)
    return {"rss": fields.get("Rss", 0), "uss": uss}


def _status_kib(field: str) -> int:
    """One ``kB`` field of /proc/self/status (VmHWM, VmRSS), in bytes; 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemorySampler:
    """Peak RSS (the kernel's high-water mark since start(), exact) and peak USS of this process between start() and
    stop(): USS read from smaps_rollup at a pace costing at most SAMPLER_CPU_SHARE of a core, and its growth at least
    that of private anonymous memory, read every SAMPLE_S (see the module docstring)."""

    def __init__(self, uss: bool = True) -> None:
        """``uss=False``: peak RSS only (no sampling thread: the kernel keeps the peak), for long stretches where
        only it is reported."""
        self.before = read_memory()
        self.anon_before = self.anon_peak = _status_kib("RssAnon")
        self.peak = dict(self.before)
        self.hwm = _reset_peak_rss()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-sync-memory", daemon=True)
        if uss or not self.hwm:
            self._thread.start()

    def _run(self) -> None:
        next_full = 0.0
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, _status_kib("RssAnon"))
            if time.monotonic() >= next_full:
                cost = time.thread_time()
                self._sample()
                cost = time.thread_time() - cost
                next_full = time.monotonic() + cost / SAMPLER_CPU_SHARE
            self._stop.wait(SAMPLE_S)

    def _sample(self) -> None:
        now = read_memory()
        self.samples += 1
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)

    def stop(self) -> Dict[str, int]:
        """Stop sampling; the idle and peak values (bytes), and how many smaps_rollup samples were taken."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sample()
        self.anon_peak = max(self.anon_peak, _status_kib("RssAnon"))
        rss_peak = max(self.peak["rss"], _status_kib("VmHWM")) if self.hwm else self.peak["rss"]
        uss_peak = max(self.peak["uss"], self.before["uss"] + self.anon_peak - self.anon_before)
        return {"rss_before": self.before["rss"], "rss_peak": rss_peak, "uss_before": self.before["uss"],
                "uss_peak": uss_peak, "uss_samples": self.samples}


def _malloc_trim() -> None:
    """glibc's malloc_trim(0); nothing elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _touch(t: torch.Tensor) -> float:
    return float(t.view(-1)[::PAGE_FLOATS].float().sum())


class WeightActor:
    """Trainer or worker of the weight-sync suite (see the module docstring)."""

    def __init__(self) -> None:
        self.params: Dict[str, torch.Tensor] = {}
        self.markers: List[str] = []
        self.count_tensors: List[torch.Tensor] = []
        self.sampler: Optional[MemorySampler] = None
        self.uss_params = 0

    # ------------------------------------------------------------------ set-up
    def setup_model(self, shapes: Sequence[Tuple[str, Shape]], fill: float) -> Dict[str, int]:
        """Allocate the state dict (bf16, every page written); the marker tensors are the first, middle and last."""
        self.params = {name: torch.full(shape, fill, dtype=torch.bfloat16) for name, shape in shapes}
        names = list(self.params)
        self.markers = sorted({names[0], names[len(names) // 2], names[-1]}, key=names.index)
        self.uss_params = read_memory()["uss"]
        return {"pid": os.getpid(), "uss": self.uss_params}

    def configure(self, **kwargs: Any) -> None:
        """rdt.configure in this actor (pool sizes, inline threshold)."""
        rdt.configure(**kwargs)

    def bcast_join(self, world_size: int, rank: int, group: str, timeout_ms: int) -> int:
        """Join the hand-written baseline's ray.util.collective Gloo group."""
        import ray.util.collective as col

        col.init_collective_group(world_size, rank, backend="gloo", group_name=group, gloo_timeout=timeout_ms)
        return rank

    # ------------------------------------------------------------------ trainer
    def update(self, value: float, wait_freed: bool, timeout: float) -> bool:
        """The training step's in-place update: set the marker elements to ``value``; for rdt rows first wait
        until rdt no longer holds the tensors (when this build has ``rdt.wait_tensor_freed``). Returns whether
        it waited."""
        waited = wait_freed and hasattr(rdt, "wait_tensor_freed")
        for name in self.markers:
            if waited:
                rdt.wait_tensor_freed(self.params[name], timeout=timeout)
            self.params[name].view(-1)[0] = value
        return waited

    def publish_plain(self) -> Dict[str, torch.Tensor]:
        """Plain return: the dict goes through Ray's object store."""
        return self.params

    @ray.method(tensor_transport="gloo")
    def publish_ray_rdt_gloo(self) -> Dict[str, torch.Tensor]:
        """Ray's built-in RDT over its torch Gloo group."""
        return self.params

    @rdt.tensor_method(tensor_transport="gloo")
    def publish_rdt_gloo(self) -> Dict[str, torch.Tensor]:
        """rdt over its Gloo group."""
        return self.params

    @rdt.tensor_method(tensor_transport="shm")
    def publish_rdt_shm(self) -> Dict[str, torch.Tensor]:
        """rdt over same-node shared memory (a direct read where the kernel allows it)."""
        return self.params

    @rdt.tensor_method(tensor_transport="nixl")
    def publish_rdt_nixl(self) -> Dict[str, torch.Tensor]:
        """rdt over NIXL."""
        return self.params

    # ------------------------------------------------------------------ worker
    def check(self, expect: float) -> float:
        """Raise WrongMarkerError unless every marker element of the parameters equals ``expect``."""
        got = {name: float(self.params[name].view(-1)[0]) for name in self.markers}
        bad = {k: v for k, v in got.items() if v != expect}
        if bad:
            raise WrongMarkerError(f"worker pid {os.getpid()}: markers {bad} != {expect} after the sync")
        return expect

    def load(self, value: Dict[str, torch.Tensor], expect: float) -> float:
        """copy_ the received state dict into the parameters, then check the marker."""
        for name, t in value.items():
            self.params[name].copy_(t)
        return self.check(expect)

    def load_into(self, refs: List[Any], expect: float, timeout: float) -> float:
        """rdt.get(ref, into=parameters): the tensors land in the parameters directly; then check the marker."""
        rdt.get(refs[0], into=self.params, timeout=timeout)  # type: ignore[attr-defined]
        return self.check(expect)

    def bcast(self, group: str, expect: Optional[float]) -> float:
        """Hand-written baseline: one ray.util.collective.broadcast per tensor from rank 0 (the trainer) straight
        into every worker's parameters."""
        import ray.util.collective as col

        for t in self.params.values():
            col.broadcast(t, 0, group)
        return self.check(expect) if expect is not None else 0.0

    def copy_reference(self, warmup: int, iters: int, threads: int = 0) -> List[float]:
        """In-process reference: seconds of ``dst.copy_(src)`` over the whole model, warm; with ``threads``, torch
        copies on that many threads (an actor's torch runs one by default)."""
        src = {name: t.clone() for name, t in self.params.items()}
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        times = []
        try:
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                for name, t in src.items():
                    self.params[name].copy_(t)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
        del src
        return times

    def share_params(self) -> bool:
        """Move the parameters into shared memory in place (``model.share_memory()``), as a trainer would for
        same-node consumers; the tensors stay the same objects."""
        for t in self.params.values():
            t.share_memory_()
        return all(t.is_shared() for t in self.params.values())

    # ------------------------------------------------------------------ memory
    def memory_start(self) -> Dict[str, int]:
        """Hand freed heap back to the kernel (glibc keeps it otherwise, and earlier steps' buffers would hide this
        step's growth), then start sampling this process's RSS and USS; returns the idle USS over the params."""
        _malloc_trim()
        self.sampler = MemorySampler()
        return {"uss_idle_over_params": self.sampler.before["uss"] - self.uss_params, "uss_params": self.uss_params,
                "torch_threads": torch.get_num_threads()}

    def memory_stop(self) -> Dict[str, int]:
        """Stop sampling; idle and peak RSS/USS during the sync."""
        sampler, self.sampler = self.sampler, None
        if sampler is None:
            raise RuntimeError("memory_stop without memory_start")
        return sampler.stop()

    # ------------------------------------------------------------------ tensor-count objects
    def make_count(self, count: int, total_bytes: int) -> int:
        """``count`` float32 tensors of ``total_bytes`` in all, filled with ones."""
        self.count_tensors = [torch.ones(total_bytes // 4 // count) for _ in range(count)]
        return sum(t.numel() for t in self.count_tensors)

    @rdt.tensor_method(tensor_transport="gloo")
    def count_rdt_gloo(self) -> List[torch.Tensor]:
        """The tensor-count object over rdt's Gloo group."""
        return self.count_tensors

    @rdt.tensor_method(tensor_transport="shm")
    def count_rdt_shm(self) -> List[torch.Tensor]:
        """The tensor-count object over rdt's shared memory."""
        return self.count_tensors

    @rdt.tensor_method(tensor_transport="nixl")
    def count_rdt_nixl(self) -> List[torch.Tensor]:
        """The tensor-count object over NIXL."""
        return self.count_tensors

    def consume_count(self, tensors: List[torch.Tensor]) -> Tuple[float, float]:
        """Plain consumption: touch one float per 4 KiB page of every tensor. Returns the checksum for the driver
        and the seconds the check itself took (a few torch ops per tensor: the driver subtracts it, since it is the
        benchmark's cost and the same for every transport, not the transfer's)."""
        t0 = time.perf_counter()
        total = sum(_touch(t) for t in tensors)
        return total, time.perf_counter() - t0


def actor_class() -> Any:
    """The remote class: no CPU reserved (the workers only wait on I/O and copy), Ray's RDT enabled (its
    consumers need enable_tensor_transport=True), no restarts."""
    return ray.remote(num_cpus=0, max_restarts=0, enable_tensor_transport=True)(WeightActor)
