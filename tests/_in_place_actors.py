"""Actors for the in-place landing test: a producer of a state dict whose every byte depends on the step, and
consumers that fetch it with ``rdt.get(ref, into=their_targets)`` and report how far their resident memory rose
meanwhile.

The rise is the kernel's own high-water mark (``VmHWM`` in ``/proc/self/status``), reset to the current RSS just
before the fetch (``/proc/self/clear_refs``, 5): every page the fetch faulted in, however briefly it lived, and no
sampling that could miss a short peak or slow the fetch. The pages of the targets themselves are faulted in when
they are made, so a fetch that lands in place raises it by its bounce buffers at most.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Dict, List, Tuple

import psutil
import ray
import torch

import rdt

Layout = List[Tuple[str, str, Tuple[int, ...]]]  # (name, dtype, shape) of each leaf, in state-dict order
MiB = 1 << 20


def layout(total: int) -> Layout:
    """Four large leaves of mixed dtypes sharing ``total`` bytes (one not a multiple of the 4 MiB relay chunk) and
    24 small ones that travel packed (staging on the consumer): a weight-sync-like state dict."""
    out: Layout = [(f"small.{i}", "float32" if i % 2 else "bfloat16", (1000 + 1531 * i,)) for i in range(24)]
    big = total // 4
    out += [("big.f32", "float32", (big // 4,)), ("big.bf16", "bfloat16", (big // 2 // 64, 64)),
            ("big.i32", "int32", (big // 4,)), ("big.odd", "uint8", (total - 3 * big + 12345,))]
    return out


def nbytes(lay: Layout) -> int:
    """Bytes of a layout's leaves."""
    total = 0
    for _, dtype, shape in lay:
        n = getattr(torch, dtype).itemsize
        for d in shape:
            n *= d
        total += n
    return total


def pattern(leaf: int, size: int, step: int) -> torch.Tensor:
    """``size`` uint8 bytes that differ per leaf and per step."""
    n4 = -(-size // 4)
    return torch.arange(n4, dtype=torch.int32).mul_(2 * step + 1).add_(leaf << 20).view(torch.uint8)[:size]


def make_state(lay: Layout, step: int) -> Dict[str, torch.Tensor]:
    """The state dict of ``step``: each leaf its :func:`pattern`, as its dtype and shape."""
    out = {}
    for i, (name, dtype, shape) in enumerate(lay):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        t.view(-1).view(torch.uint8).copy_(pattern(i, t.nbytes, step))
        out[name] = t
    return out


def _status() -> Dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


@ray.remote(num_cpus=0)
class IntoNode:
    """Producer (``publish_*``) or consumer (``make_targets``, ``fetch``) of the in-place test."""

    def __init__(self) -> None:
        self.lay: Layout = []
        self.targets: Dict[str, torch.Tensor] = {}

    def where(self) -> str:
        return rdt.__file__

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    @rdt.tensor_method(tensor_transport="gloo")
    def publish_gloo(self, lay: Layout, step: int) -> Dict[str, torch.Tensor]:
        return make_state(lay, step)

    @rdt.tensor_method(tensor_transport="shm")
    def publish_shm(self, lay: Layout, step: int) -> Dict[str, torch.Tensor]:
        return make_state(lay, step)

    @rdt.tensor_method(tensor_transport="nixl")
    def publish_nixl(self, lay: Layout, step: int) -> Dict[str, torch.Tensor]:
        return make_state(lay, step)

    def make_targets(self, lay: Layout) -> int:
        """Preallocate the targets, every page written (resident before any fetch is measured)."""
        self.lay = lay
        self.targets = {name: torch.full(shape, 7, dtype=getattr(torch, dtype)) for name, dtype, shape in lay}
        return sum(t.nbytes for t in self.targets.values())

    def fetch(self, refs: List[Any], step: int, start: float, timeout: float) -> Dict[str, Any]:
        """At wall-clock ``start``, ``rdt.get(refs[0], into=targets)``: how far RSS rose above its value just
        before (the peak) and USS after, the path that served, whether the value's leaves are the targets and
        whether every byte is the step's."""
        time.sleep(max(0.0, start - time.time()))
        proc = psutil.Process()
        paths = dict(rdt.stats()["paths"])
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        rss0, uss0 = _status()["VmRSS"], proc.memory_full_info().uss
        t0 = time.perf_counter()
        value = rdt.get(refs[0], into=self.targets, timeout=timeout)
        seconds = time.perf_counter() - t0
        peak, uss1 = _status()["VmHWM"], proc.memory_full_info().uss
        now = rdt.stats()["paths"]
        same = all(value[name] is t for name, t in self.targets.items())
        right = all(torch.equal(t.view(-1).view(torch.uint8), pattern(i, t.nbytes, step))
                    for i, t in enumerate(self.targets.values()))
        return {"rss_peak_growth": peak - rss0, "uss_growth": uss1 - uss0, "seconds": seconds, "same": same,
                "bytes_right": right, "paths": sorted(k for k in now if now[k] != paths.get(k, 0)),
                "pid": os.getpid()}
