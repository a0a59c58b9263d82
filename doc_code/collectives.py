"""rdt_transports: a collective group declared from the driver, collectives inside actors, typed timeouts.

Run: python doc_code/collectives.py
"""

import os

# Loopback only, and quiet transport libraries; set before Ray starts so its workers inherit them.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt_transports as rt  # noqa: E402

GROUP = "demo"


@ray.remote(num_cpus=0)
class Rank:
    def step(self):
        rank, world = rt.get_rank(GROUP), rt.get_collective_group_size(GROUP)

        t = torch.full((1024,), float(rank + 1))
        rt.allreduce(t, GROUP)  # default op SUM; backend-native on Gloo (algorithm="auto")
        assert float(t[0]) == world * (world + 1) / 2

        r = torch.full((1024,), float(rank + 1))
        rt.allreduce(r, GROUP, op=rt.ReduceOp.MAX, algorithm="ring", timeout=10.0)  # p2p ring over Gloo
        assert float(r[0]) == world

        b = torch.arange(8.0) if rank == 0 else torch.zeros(8)
        rt.broadcast(b, src_rank=0, group_name=GROUP, algorithm="tree")
        assert b.tolist() == list(range(8))

        outs = [torch.empty(4) for _ in range(world)]
        rt.allgather(outs, torch.full((4,), float(rank)), GROUP)
        assert [float(o[0]) for o in outs] == [float(i) for i in range(world)]

        # send/recv around a ring: everyone sends to the next rank and receives from the previous one
        # (the lower half sends first, so the pairs never wait on each other)
        out, inp = torch.full((16,), float(rank)), torch.empty(16)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            rt.send(out, nxt, GROUP)
            rt.recv(inp, prv, GROUP)
        else:
            rt.recv(inp, prv, GROUP)
            rt.send(out, nxt, GROUP)
        assert float(inp[0]) == prv
        return rank

    def recv_nobody_sends(self):
        """A recv whose sender never comes: a typed timeout, after which the group is ERRORED."""
        t = torch.empty(4)
        try:
            rt.recv(t, src_rank=1, group_name=GROUP, timeout=1.0)
        except rt.CollectiveTimeoutError as e:
            first = (type(e).__name__, e.group, e.rank, e.peer, e.op)
        state = rt.get_group(GROUP).state
        try:
            rt.barrier(GROUP)
        except rt.GroupErroredError as e:
            second = type(e).__name__
        return first, state.value, second


ray.init(num_cpus=4, include_dashboard=False)
ranks = [Rank.remote() for _ in range(3)]

group = rt.create_collective_group(ranks, backend="gloo", group_name=GROUP)
assert group.world_size == 3 and group.rank_of(ranks[2]) == 2
assert ray.get([r.step.remote() for r in ranks]) == [0, 1, 2]

first, state, second = ray.get(ranks[0].recv_nobody_sends.remote())
print("timeout:", first, "| state:", state, "| next call:", second)
assert first == ("CollectiveTimeoutError", GROUP, 0, 1, "recv")
assert state == "errored" and second == "GroupErroredError"

# An errored group is destroyed on every member and formed again (same name, new incarnation).
rt.destroy_collective_group(group)
group = rt.create_collective_group(ranks, backend="gloo", group_name=GROUP)
assert ray.get([r.step.remote() for r in ranks]) == [0, 1, 2]
rt.destroy_collective_group(group)

# Capabilities are known without creating a group.
caps = rt.capabilities("gloo")
assert caps.devices == frozenset({"cpu"}) and "allreduce" in caps.native_collectives

ray.shutdown()
print("collectives: OK")
