"""Passing a ref back to its producer gives the very same tensors; other consumers get private copies.

Also shows the default mutability (consumers see the producer's tensor as it is when they fetch it) and
``snapshot=True``. Run: python doc_code/pass_to_producer.py
"""

import os

# Loopback only, and quiet transport libraries; set before Ray starts so its workers inherit them.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402

N = 1 << 16  # 256 KiB of float32: above the 64 KiB inline threshold, so the tensor stays in the producer


@ray.remote(num_cpus=0)
class Worker:
    @rdt.tensor_method(tensor_transport="gloo")
    def make(self):
        self.kept = torch.ones(N)
        return {"w": self.kept}

    @rdt.tensor_method(tensor_transport="gloo", snapshot=True)
    def make_snapshot(self):
        self.kept = torch.ones(N)
        return {"w": self.kept}

    def is_mine(self, value):
        return value["w"] is self.kept  # the producer receives its own tensor object

    def fill_kept(self, x):
        self.kept.fill_(x)  # in place, after the method returned

    def add_and_sum(self, value):
        value["w"].add_(100.0)  # a consumer's copy is private: only this task sees the change
        return float(value["w"].sum())

    def total(self, value):
        return float(value["w"].sum())


ray.init(num_cpus=4, include_dashboard=False)
producer, c1, c2 = Worker.remote(), Worker.remote(), Worker.remote()
group = rdt.create_collective_group([producer, c1, c2], backend="gloo")

ref = producer.make.remote()

# Back to the producer: the very same tensor object (no transfer, no copy).
assert ray.get(producer.is_mine.remote(ref)) is True
assert "gloo" not in rdt.stats(producer)["transfers"]

# Other consumers each get their own copy; mutating it changes nothing elsewhere.
assert ray.get(c1.add_and_sum.remote(ref)) == 101.0 * N
assert ray.get(c2.total.remote(ref)) == 1.0 * N  # another consumer is unaffected
assert ray.get(c1.total.remote(ref)) == 1.0 * N  # a later task of the same consumer fetches afresh
assert ray.get(producer.total.remote(ref)) == 1.0 * N  # the producer's tensor is unchanged

# Without snapshot, the producer's tensor is shared state: an in-place change made after the method returned
# is what later consumers (and the producer itself) see.
ray.get(producer.fill_kept.remote(3.0))
assert ray.get(c1.total.remote(ref)) == 3.0 * N

# snapshot=True copies the tensors at return time, so later in-place changes stay private to the producer.
snap = producer.make_snapshot.remote()
ray.wait([snap])
ray.get(producer.fill_kept.remote(5.0))
assert ray.get(c1.total.remote(snap)) == 1.0 * N
assert ray.get(producer.is_mine.remote(snap)) is False  # the snapshot is a copy, not self.kept

rdt.destroy_collective_group(group)
ray.shutdown()
print("pass_to_producer: OK")
