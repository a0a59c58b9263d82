"""Quickstart: keep a method's tensors in the actor and move them over a Gloo group.

Run: python doc_code/quickstart_gloo.py
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


@ray.remote
class Trainer:
    @rdt.tensor_method(tensor_transport="gloo")
    def weights(self):
        self.w = torch.randn(1024, 1024)  # 4 MiB: stays in this actor
        return {"w": self.w, "step": 7}

    def apply(self, value):
        # `value` arrives as the real dict: rdt fetched the tensor while Ray deserialized the argument.
        return {
            "step": value["step"],
            "sum": float(value["w"].sum()),
            "same_tensor": value["w"] is getattr(self, "w", None),
        }


ray.init(num_cpus=4, include_dashboard=False)

a, b = Trainer.remote(), Trainer.remote()
group = rdt.create_collective_group([a, b], backend="gloo")

ref = a.weights.remote()  # the ref's value is metadata; the 4 MiB tensor stays in a

out_b = ray.get(b.apply.remote(ref))  # b fetches the tensor from a over the Gloo group
out_a = ray.get(a.apply.remote(ref))  # back to the producer: the very same tensor object, no copy
value = ray.get(ref)  # the driver is not in the group: served through Ray's object store

assert out_b["step"] == 7 and out_b["same_tensor"] is False
assert out_a["same_tensor"] is True
assert out_a["sum"] == out_b["sum"]
assert value["step"] == 7 and value["w"].shape == (1024, 1024)
assert abs(float(value["w"].sum()) - out_a["sum"]) < 1e-3

s = rdt.stats(a)
print("producer stats:", s)
assert s["objects"] >= 1 and s["bytes"] >= 1024 * 1024 * 4
assert s["transfers"]["gloo"]["out"] == 1  # one transfer to b
assert s["transfers"]["object_store"]["out"] == 1  # one to the driver
assert rdt.stats(b)["transfers"]["gloo"]["in"] == 1

rdt.destroy_collective_group(group)

del ref, value  # the last references: a frees the tensor
ray.shutdown()
print("quickstart_gloo: OK")
