"""A driver program that uses every transport and then exits normally: run by tests/test_exit.py in a subprocess.

It ends with an rdt thread still blocked in a Gloo receive that can never complete (a user thread) and a NIXL
agent polling in the background: both are exactly what made the interpreter abort at exit. Its last atexit
callback (registered first, so it runs last) prints the rdt threads still alive at that point.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("GLOO_SOCKET_IFNAME", "lo"),
                   ("UCX_NET_DEVICES", "lo"), ("UCX_WARN_UNUSED_ENV_VARS", "n"), ("NIXL_LOG_LEVEL", "WARN")):
    os.environ.setdefault(key, value)


def _report() -> None:
    me = threading.current_thread()
    live = sorted(t.name for t in threading.enumerate() if t is not me and t.is_alive() and t.name.startswith("rdt"))
    print("RDT_LIVE_THREADS=" + ",".join(live), flush=True)


atexit.register(_report)

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402
import rdt_transports  # noqa: E402


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        rdt.configure(inline_threshold=0)

    @rdt.tensor_method(tensor_transport="nixl")
    def nixl(self) -> torch.Tensor:
        return torch.full((1 << 16,), 2.0)

    @rdt.tensor_method(tensor_transport="shm")
    def shm(self) -> torch.Tensor:
        return torch.full((1 << 16,), 3.0)

    @rdt.tensor_method(tensor_transport="gloo")
    def gloo(self) -> torch.Tensor:
        return torch.full((1 << 16,), 4.0)

    @rdt.tensor_method(tensor_transport="object_store")
    def store(self) -> torch.Tensor:
        return torch.full((1 << 16,), 5.0)

    def join(self, world: int, rank: int, backend: str, name: str) -> None:
        rdt_transports.init_collective_group(world, rank, backend, name, timeout=60)

    def send_to(self, dst: int, name: str) -> None:
        rdt_transports.send(torch.ones(1024), dst, name, timeout=60)


def main() -> int:
    # The local cluster's processes inherit the variables set above: no job runtime_env (it would start every
    # worker through Ray's setup_worker, an extra interpreter per actor).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=200 << 20)
    rdt.configure(inline_threshold=0)
    a, b = Producer.remote(), Producer.remote()
    # Started first, on a generous bound: on a loaded machine two actors importing torch can take longer than the
    # group's own 30 s join timeout, which this test is not about.
    ray.get([a.__ray_ready__.remote(), b.__ray_ready__.remote()], timeout=180)
    group = rdt.create_collective_group([a, b], backend="gloo", timeout=60)
    expected = {"nixl": 2.0, "shm": 3.0, "gloo": 4.0, "store": 5.0}
    for method, value in expected.items():
        got = ray.get(getattr(a, method).remote())  # the driver's own path: NIXL READ, direct read, fallbacks
        assert float(got[0]) == value, (method, got)
    print("stats:", sorted(rdt.stats(a)["transfers"]), flush=True)
    # The driver itself joins a Gloo, a UCX, a NIXL and a tcp group with one actor each, and moves data in each.
    for backend in ("gloo", "ucx", "nixl", "tcp"):
        name = f"exit-{backend}"
        joined = b.join.remote(2, 1, backend, name)
        rdt_transports.init_collective_group(2, 0, backend, name, timeout=60)
        ray.get(joined)
        t = torch.zeros(1024)
        sent = b.send_to.remote(0, name)
        rdt_transports.recv(t, 1, name, timeout=60)
        ray.get(sent)
        assert float(t.sum()) == 1024.0
    # A receive that can never complete, blocked inside Gloo on a user thread while the program exits.
    stuck = threading.Thread(target=_recv_forever, args=("exit-gloo", "STUCK_RECV"), name="user-stuck-recv",
                             daemon=True)
    stuck.start()
    stuck_tcp = threading.Thread(target=_recv_forever, args=("exit-tcp", "STUCK_TCP_RECV"), name="user-stuck-tcp",
                                 daemon=True)
    stuck_tcp.start()
    rdt.destroy_collective_group(group)
    print("DRIVER_DONE", flush=True)
    return 0


def _recv_forever(name: str, label: str) -> None:
    try:
        rdt_transports.recv(torch.zeros(8), 1, name, timeout=600)
    except rdt_transports.RdtError as e:
        print(f"{label}_ENDED={type(e).__name__}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
