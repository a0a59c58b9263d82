"""NIXL between two actors with no collective group: the consumer READs the producer's memory one-sidedly.

Run: python doc_code/nixl_no_group.py   (exits 0 with a message when NIXL is not installed)
"""

import os

# Loopback only, and quiet transport libraries; set before Ray starts so its workers inherit them.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import importlib.util  # noqa: E402
import sys  # noqa: E402

if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu13", "nixl_cu12")):
    print("nixl is not installed (pip install 'ray-direct-transport[nixl]'): skipping this example")
    sys.exit(0)

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402


@ray.remote(num_cpus=0)
class Producer:
    @rdt.tensor_method(tensor_transport="nixl")
    def make(self, fill):
        # Registered with this process's NIXL agent when the method returns.
        return {"w": torch.full((1 << 20,), fill), "x": torch.arange(1 << 16)}


@ray.remote(num_cpus=0)
class Consumer:
    def total(self, value):
        return float(value["w"].sum()) + float(value["x"].sum())


ray.init(num_cpus=4, include_dashboard=False)
p, c = Producer.remote(), Consumer.remote()  # no rdt.create_collective_group anywhere

expect_x = float(torch.arange(1 << 16).sum())
assert ray.get(c.total.remote(p.make.remote(2.0))) == 2.0 * (1 << 20) + expect_x
assert ray.get(c.total.remote(p.make.remote(3.0))) == 3.0 * (1 << 20) + expect_x

s = rdt.stats(c)
assert s["transfers"]["nixl"]["in"] == 2
print("consumer stats:", s["transfers"])

ray.shutdown()
print("nixl_no_group: OK")
