"""Sync a model's weights into parameters a worker already holds, every step, with no copy on either side.

The trainer returns its state dict from an rdt method (the tensors stay in the trainer); each worker receives the
bytes straight into its own preallocated parameters with ``rdt.get(ref, into=...)``. Before updating its weights
in place for the next step, the trainer waits with ``rdt.wait_tensor_freed`` until no object of the last step still
holds them, so no ``snapshot=True`` copy is needed. The trainer keeps its weights in shared memory
(``model.share_memory()``): same-node workers then map them once and copy from the mapping every step (the path
``shm-map`` in ``rdt.stats()``), the fastest CPU path rdt has.

Run: python doc_code/weight_sync_into.py
"""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))


@ray.remote
class Trainer:
    def __init__(self) -> None:
        self.model = model()
        self.model.share_memory()  # in place: the parameters stay the same tensors

    @rdt.tensor_method(tensor_transport="shm")
    def weights(self, step: int):
        return {"state": self.model.state_dict(), "step": step}

    def train_step(self) -> None:
        for p in self.model.parameters():
            rdt.wait_tensor_freed(p, timeout=60)  # every worker is done with the last step's object
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)  # in place: the returned state dict views these very tensors

    def checksum(self) -> float:
        return float(sum(p.sum() for p in self.model.parameters()))


@ray.remote
class Worker:
    def __init__(self) -> None:
        self.model = model()
        self.params = dict(self.model.state_dict())  # the tensors the bytes land in

    def load(self, refs) -> int:
        value = rdt.get(refs[0], into={"state": self.params})  # nested in a list: Ray did not resolve it
        assert all(value["state"][k] is self.params[k] for k in self.params)  # the very same tensors
        return value["step"]

    def checksum(self) -> float:
        return float(sum(p.sum() for p in self.model.parameters()))


ray.init(num_cpus=2, include_dashboard=False)
trainer, workers = Trainer.remote(), [Worker.remote(), Worker.remote()]
for step in range(3):
    ref = trainer.weights.remote(step)
    assert ray.get([w.load.remote([ref]) for w in workers]) == [step, step]
    del ref  # the last reference of this step's object
    ray.get(trainer.train_step.remote())
ref = trainer.weights.remote(3)
ray.get([w.load.remote([ref]) for w in workers])
expected = ray.get(trainer.checksum.remote())
assert ray.get([w.checksum.remote() for w in workers]) == [expected, expected]
print("paths that served worker 0:", rdt.stats(workers[0])["paths"])
ray.shutdown()
print("weight_sync_into: OK")
