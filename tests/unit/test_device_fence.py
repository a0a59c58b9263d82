"""Stream and fence order of a sharded load into GPU targets, against recording fake streams (CPU tensors stand for
device memory; copies queued on a fake stream run only when an event after them is synchronised, as kernels run
later on a GPU). A rank's read over CUDA IPC, through the consumer's one road (``_read_rank`` -> ``fetch_ranges`` ->
the transport's ``read_ranges``): its copies follow the caller's stream mark, are finished on the device before the
read ends its registration with the producer, and so the producer's fence (the real version table) returns only
after they finished: an in-place update right after the fence cannot reach the landed bytes. A path that ended the
read after merely enqueueing its copies is caught (the negative control)."""

from __future__ import annotations

import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rdt._consumer import cover, ranges as road
from rdt._consumer.ranges import RangeRead, Runs
from rdt._objects import device_order
from rdt._objects.meta import ObjectMeta, ProducerInfo
from rdt._objects.specs import BufferSpec, TensorSpec
from rdt._process.versions import Versions
from rdt._sharded import rank_reads, register
from rdt._sharded.publish import ParamInfo, Shards
from rdt._control import wire
from rdt.transports import Ranges, Site
from rdt.transports.cuda_ipc import ranges as ipc_ranges, shares

from .._bare_context import BareContext
from ._fake_streams import Recorder, order_of

UUID = "GPU-fake-0"
OBJ = b"\x07" * 16


class _Ctx(BareContext):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(range_costs={})
        self.stats = SimpleNamespace(add=lambda *a, **k: None)


def _setup(monkeypatch, weights: torch.Tensor):
    """A producer's 8 x 64 fp32 weight 'shared' over CUDA IPC (the fake opener hands out ``weights`` itself), and a
    rank read of its column slice 16..48 into an 8 x 32 'GPU' target."""
    monkeypatch.setattr(shares, "visible_devices", lambda: {UUID: 0})
    monkeypatch.setattr(Ranges, "device", property(lambda self: torch.device("cuda", 0)))  # the target's device
    monkeypatch.setattr(road, "site_for", lambda meta, task_argument=None: Site(
        same_node=True, in_actor=True, task_argument=False, cuda_device=torch.device("cuda", 0)))
    storage = weights.view(-1).view(torch.uint8)
    info = shares.CudaIpcInfo((shares.IpcBuffer(UUID, 0, b"h", storage.numel(), 0, b"rc", 0, None, False, 0,
                                                storage.numel(), 1),))
    producer = ProducerInfo(b"producer", 1, "node", "127.0.0.1:1", b"k" * 32, None, "a" * 32)
    meta = ObjectMeta(OBJ, "cuda_ipc", producer, b"", [TensorSpec(0, "float32", (8, 64), (64, 1), 0, 0)],
                      [BufferSpec(storage.numel(), "cuda:0")], (), None, (("cuda_ipc", info),))
    shards = Shards(0, 3, (ParamInfo("w", "float32", (8, 64), ((0, 8), (0, 64))),), meta)
    rows = np.arange(8)
    parts = [(np.zeros(8, np.int64), (rows * 64 + 16) * 4, np.zeros(8, np.int64), rows * 32 * 4,
              np.full(8, 32 * 4))]
    rr = RangeRead(Runs(*cover.merge(*[np.concatenate(c) for c in zip(*parts)]), groups=cover.groups(parts)))
    ctx = _Ctx()
    ctx.transport_state("cuda_ipc-mappings", lambda: ipc_ranges.Mappings(lambda b, index: storage))
    return ctx, shards, rr


def _target(ctx, shards, rr, rec, target, versions=None):
    """Run the rank's read with the caller's queued work and a recorded end of its registration (the producer's
    version table's end when given): (what the end saw in the target, the log)."""
    seen = {}

    def end(ctx_, shards_, reader, deadline):
        seen["target"] = target.clone()
        rec.note("end")
        if versions is not None:
            return versions.handle_end(struct.pack("!16s16s", OBJ, reader))[1] == b"\x01"
        return True

    rec.caller_queues(lambda: target.fill_(-1.0))  # e.g. the engine's own write, queued before the load
    with device_order.use(rec), pytest.MonkeyPatch.context() as mp:
        mp.setattr(register, "end", end)
        out = rank_reads.read_rank(ctx, shards, rr, b"r" * 16, [target], np.array(
            [target.data_ptr()], np.uint64), None, time.monotonic() + 30, rec.mark(target.device))
    assert out.landed.label == "cuda_ipc" and out.held
    return seen["target"]


def test_copies_follow_the_callers_stream_and_finish_before_the_read_ends(monkeypatch):
    weights = torch.randn(8, 64)
    ctx, shards, rr = _setup(monkeypatch, weights)
    rec, target = Recorder(), torch.zeros(8, 32)
    at_end = _target(ctx, shards, rr, rec, target)
    want = weights[:, 16:48]
    assert torch.equal(at_end, want) and torch.equal(target, want)
    log = rec.log
    assert order_of(log, "mark") < order_of(log, "wait", "e1@caller") < order_of(log, "run") \
        < order_of(log, "synchronize") < order_of(log, "end"), log
    assert rec.pending() == 0


def test_a_read_that_ends_before_its_copies_finished_is_caught(monkeypatch):
    """The negative control: with the wait for the copies taken out, the end of the read sees the target before
    the copy landed (the producer could update in place while the copy still reads its memory)."""
    weights = torch.randn(8, 64)
    ctx, shards, rr = _setup(monkeypatch, weights)
    rec, target = Recorder(), torch.zeros(8, 32)
    rec.finish = lambda stream: None  # type: ignore[method-assign]
    at_end = _target(ctx, shards, rr, rec, target)
    assert not torch.equal(at_end, weights[:, 16:48])


def test_the_fence_returns_only_after_the_copies_reading_its_shards_finished(monkeypatch):
    """The real version table: a reader registered, the trainer fences (its thread blocks), the read's copies are
    deferred until synchronised; the fence returns after the read's end, which comes after the synchronise, and the
    trainer's in-place update right after the fence leaves the landed bytes those of the fenced version."""
    weights = torch.randn(8, 64)
    before = weights[:, 16:48].clone()
    ctx, shards, rr = _setup(monkeypatch, weights)
    versions = Versions(lambda obj_id: None, lambda obj_id: None)
    versions.publish(OBJ, ("rank", 0), 0, 3, 0, 0)
    assert versions.handle_begin(struct.pack("!16sQ16sI", OBJ, 3, b"r" * 16, 30000) + b"engine")[0] == wire.RESP_OK
    rec = Recorder()
    fenced = threading.Event()

    def trainer() -> None:
        versions.fence(OBJ, 0, 3, timeout=30.0)
        rec.note("fence returned")
        weights.add_(1000.0)  # optimizer.step() in place, right after the fence
        fenced.set()

    t = threading.Thread(target=trainer)
    t.start()
    time.sleep(0.3)
    assert not fenced.is_set()  # blocked by the registered read
    target = torch.zeros(8, 32)
    _target(ctx, shards, rr, rec, target, versions)
    assert fenced.wait(10)
    t.join(10)
    log = rec.log
    assert order_of(log, "synchronize") < order_of(log, "end") < order_of(log, "fence returned"), log
    assert torch.equal(target, before)
