"""Values with many tensors: dicts, lists, dataclasses, views of one storage, numpy arrays, num_returns=2.

rdt finds every tensor wherever pickle finds it; everything else travels as ordinary pickled data.
Run: python doc_code/nested_tensors.py
"""

import os

# Loopback only, and quiet transport libraries; set before Ray starts so its workers inherit them.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str


@ray.remote(num_cpus=0)
class Producer:
    @rdt.tensor_method(tensor_transport="shm")
    def nested(self):
        base = torch.arange(1 << 16, dtype=torch.float32)
        return {
            "layers": [torch.ones(1 << 14), torch.zeros(1 << 14)],
            "batch": Batch(torch.ones(4096), torch.arange(12).reshape(3, 4), "hello"),
            # three views of one storage: its bytes move once, and they stay views of one storage
            "views": (base, base[10:20], base.view(256, -1)),
            "np": np.arange(1 << 14, dtype=np.float64),
            "meta": {"epoch": 3, "tags": ["a", "b"]},
        }

    @rdt.tensor_method(tensor_transport="shm", num_returns=2)
    def pair(self):
        return torch.full((1 << 16,), 1.0), torch.full((1 << 16,), 2.0)


@ray.remote(num_cpus=0)
class Consumer:
    def inspect(self, v):
        base, window, grid = v["views"]
        base[15] = -1.0  # one storage: visible through the other views
        return {
            "layers": [float(t.sum()) for t in v["layers"]],
            "batch": (type(v["batch"]).__name__, float(v["batch"].x.sum()), v["batch"].y.tolist(), v["batch"].note),
            "views_shared": bool(window[5] == -1.0) and bool(grid.reshape(-1)[15] == -1.0),
            "one_storage": base.untyped_storage().data_ptr() == window.untyped_storage().data_ptr(),
            "np": (type(v["np"]).__name__, str(v["np"].dtype), float(v["np"].sum())),
            "meta": v["meta"],
        }

    def add(self, a, b):
        return float((a + b).sum())


ray.init(num_cpus=4, include_dashboard=False)
p, c = Producer.remote(), Consumer.remote()

out = ray.get(c.inspect.remote(p.nested.remote()))
assert out["layers"] == [float(1 << 14), 0.0]
assert out["batch"] == ("Batch", 4096.0, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], "hello")
assert out["views_shared"] and out["one_storage"]
assert out["np"] == ("ndarray", "float64", float(np.arange(1 << 14).sum()))
assert out["meta"] == {"epoch": 3, "tags": ["a", "b"]}

# num_returns=2: each returned element is its own rdt object with its own ref.
r1, r2 = p.pair.remote()
assert ray.get(c.add.remote(r1, r2)) == 3.0 * (1 << 16)

# The consumer got one transfer per object (the nested value, then r1 and r2), all over shared memory.
assert rdt.stats(c)["transfers"]["shm"]["in"] == 3

ray.shutdown()
print("nested_tensors: OK")
