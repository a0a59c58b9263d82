"""A transport of your own: objects move through a directory of files (same node), registered in every process.

The contract (docs/transports.md, "Writing a transport"): declare capabilities; export at return (write each
buffer to a file, the descriptor names them); fetch in the consumer (read them back); release when the object is
freed (delete the files). Registration reaches the actors through Ray's worker_process_setup_hook, so every
process that produces or reads "files" objects knows the transport.

Run: python doc_code/custom_transport.py
"""

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Optional, Tuple

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402
from rdt.transports import Capabilities, Fetched, Site, Transport  # noqa: E402

DIRECTORY = tempfile.mkdtemp(prefix="rdt-files-")


@dataclass(frozen=True)
class FileDescriptor:
    """What travels in the ref's metadata: the files holding each buffer."""

    paths: Tuple[str, ...]


class FileTransport(Transport):
    capabilities = Capabilities(name="files", devices=frozenset({"cpu"}), one_sided=True, same_node=True)

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[FileDescriptor]:
        paths = []
        for i, buf in enumerate(entry.buffers):  # uint8 byte ranges of the producer's tensors
            path = os.path.join(self.directory, f"{entry.obj_id.hex()}-{i}")
            with open(path, "wb") as f:
                f.write(buf.numpy().tobytes())
            paths.append(path)
        entry.exports["files"] = paths  # what release() must undo
        return FileDescriptor(tuple(paths))

    def fetch(self, ctx: Any, meta: Any, site: Site, deadline: float) -> Fetched:
        desc: FileDescriptor = meta.export("files")
        bufs = []
        for path in desc.paths:
            with open(path, "rb") as f:
                bufs.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
        return Fetched(bufs, "files")  # the label rdt.stats reports for this path

    def release(self, ctx: Any, entry: Any) -> None:
        for path in entry.exports.pop("files", ()):
            os.unlink(path)


def register() -> None:
    """Runs in the driver and, through worker_process_setup_hook, in every worker before it does anything."""
    rdt.register_transport(FileTransport(DIRECTORY))


register()  # before any tensor_method names the transport


@ray.remote
class Worker:
    @rdt.tensor_method(tensor_transport="files")
    def weights(self):
        self.w = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB: above the inline threshold
        return {"w": self.w, "step": 3}

    def total(self, value) -> float:
        return float(value["w"].sum())

    def stats(self):
        return rdt.stats()


ray.init(num_cpus=2, include_dashboard=False, runtime_env={"worker_process_setup_hook": register})
a, b = Worker.remote(), Worker.remote()

ref = a.weights.remote()
expected = float(torch.arange(1 << 16, dtype=torch.float32).sum())
assert ray.get(b.total.remote(ref)) == expected  # b read the files a wrote
assert float(ray.get(ref)["w"].sum()) == expected  # so did the driver
assert len(os.listdir(DIRECTORY)) == 1  # one buffer, one file
assert ray.get(b.stats.remote())["paths"].get("files") == 1  # the path that served b's fetch

del ref  # the last reference: a frees the object and the transport deletes its file
import time  # noqa: E402

deadline = time.monotonic() + 20
while os.listdir(DIRECTORY) and time.monotonic() < deadline:
    time.sleep(0.1)
assert os.listdir(DIRECTORY) == [], os.listdir(DIRECTORY)
ray.shutdown()
os.rmdir(DIRECTORY)
print("custom_transport: OK")
