"""Process lifecycle: a program that used every transport exits cleanly, and a forked child never harms its parent.

Both run in a fresh subprocess: what is tested is the interpreter's exit itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import HAS_NIXL, HAS_UCXX

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(not (HAS_NIXL and HAS_UCXX), reason="needs nixl-cu13 and ucxx (the [all] extra)")
def test_driver_using_every_transport_exits_cleanly():
    """Exit code 0, no rdt thread alive after the exit hooks, and a receive blocked in Gloo is ended, not left."""
    proc = _run([str(ROOT / "tests" / "_exit_driver.py")], timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    assert "DRIVER_DONE" in out, out
    live = [line for line in out.splitlines() if line.startswith("RDT_LIVE_THREADS=")]
    assert live == ["RDT_LIVE_THREADS="], f"rdt threads still running at exit: {live}\n{proc.stderr[-2000:]}"
    assert "STUCK_RECV_ENDED=GroupDestroyedError" in out, out
    assert "STUCK_TCP_RECV_ENDED=GroupDestroyedError" in out, out


_PEER_CLOSES_FIRST = textwrap.dedent(
    """
    import sys, threading, time
    import ray, torch
    import rdt_transports
    from rdt_transports import _lifecycle

    ray.init(address=sys.argv[1], log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Peer:
        def join(self, name):
            rdt_transports.init_collective_group(2, 1, "gloo", name, timeout=60)

    peer = Peer.remote()
    joined = peer.join.remote("exit-order")
    group = rdt_transports.init_collective_group(2, 0, "gloo", "exit-order", timeout=60)
    ray.get(joined)

    def recv_forever():
        try:
            rdt_transports.recv(torch.zeros(8), 1, "exit-order", timeout=600)
        except rdt_transports.RdtError as e:
            print(f"STUCK_RECV_ENDED={type(e).__name__}: {e}", flush=True)

    stuck = threading.Thread(target=recv_forever, daemon=True)
    stuck.start()
    deadline = time.monotonic() + 30
    while group.blocked_for(time.monotonic()) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)

    def peer_closes_first():
        # Runs first among the exit stoppers: the peer's sockets close while this process is exiting but before
        # its own stopper aborts the group (as when the driver's dropped handles end its actors at exit).
        ray.kill(peer)
        stuck.join(30)

    _lifecycle.at_exit(peer_closes_first)
    print("DRIVER_DONE", flush=True)
    """
)


def test_receive_ended_by_exit_reports_destroyed_even_when_the_peer_closed_first(ray_cluster, tmp_path):
    """At exit a blocked receive ends with GroupDestroyedError, also when the peer's socket closed before this
    process's exit stopper aborted the group: the process is destroying its groups either way."""
    script = tmp_path / "peer_closes_first.py"
    script.write_text(_PEER_CLOSES_FIRST)
    proc = _run([str(script), ray_cluster.get_runtime_context().gcs_address], timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "DRIVER_DONE" in out, out + proc.stderr[-2000:]
    assert "STUCK_RECV_ENDED=GroupDestroyedError" in out, out + proc.stderr[-2000:]


_FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, secrets
    import torch
    from rdt.transports.shm import segments as _shm
    from rdt.transports.shm.state import state as shm_state
    from rdt._process.context import get_context
    from rdt._objects.flatten import flatten
    from rdt._objects.table import Entry

    ctx = get_context()
    obj_id = secrets.token_bytes(16)
    flat = flatten(torch.arange(1 << 16, dtype=torch.float32))
    entry = Entry(obj_id, flat, "shm")
    seg = entry.exports["shm"] = shm_state(ctx).pool.write(flat.buffers, obj_id)
    ctx.table.add(entry)
    spare = shm_state(ctx).pool.write(flat.buffers, secrets.token_bytes(16))
    shm_state(ctx).pool.release(spare)  # a pooled, free segment
    assert spare.name in shm_state(ctx).pool.names()

    pid = os.fork()
    if pid == 0:  # the child: fresh state, then a normal interpreter exit (exit hooks run)
        fresh = get_context()
        ok = fresh is not ctx and len(fresh.table) == 0 and shm_state(fresh).pool.names() == []
        print("CHILD_FRESH=" + str(ok), flush=True)
        sys.exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    print("CHILD_EXIT=" + str(os.waitstatus_to_exitcode(status)), flush=True)
    bufs = _shm.map_segment(seg.name, seg.layout, obj_id)  # raises if the child cleared the header
    intact = bool(torch.equal(bufs[0].view(torch.float32), torch.arange(1 << 16, dtype=torch.float32)))
    del bufs
    pooled = os.path.exists(os.path.join(_shm.SHM_DIR, spare.name))
    print(f"PARENT_INTACT={intact and pooled}", flush=True)
    """
)


def test_forked_child_starts_fresh_and_leaves_the_parent_intact(tmp_path):
    """After fork the child has an empty rdt context; its exit clears none of the parent's segments."""
    script = tmp_path / "fork_child.py"
    script.write_text(_FORK_SCRIPT)
    proc = _run([str(script)], timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "CHILD_FRESH=True" in out and "CHILD_EXIT=0" in out, out + proc.stderr[-2000:]
    assert "PARENT_INTACT=True" in out, out + proc.stderr[-2000:]


_FORK_WHILE_LOCKED_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import rdt_transports._lifecycle as lifecycle
    import rdt._process.context as rdt_context
    import rdt_transports._context as rt_context
    import rdt.transports as transports
    import rdt.transports.cuda_ipc.shares as shares

    def child_exits(pid, within=10.0):
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status) == 0
            time.sleep(0.01)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return False

    def fork_while(lock, what):
        # another thread holds ``lock`` (as a registration, a context under construction or an import does) while
        # this one forks: the child must still use rdt, then exit
        held, release = threading.Event(), threading.Event()

        def hold():
            with lock:
                held.set()
                release.wait(10.0)

        t = threading.Thread(target=hold)
        t.start()
        held.wait(10.0)
        pid = os.fork()
        if pid == 0:
            lifecycle.at_exit(lambda: None)
            rdt_context.get_context()
            rt_context.get_context()
            transports.get("shm")
            shares.visible_devices()
            os._exit(0)
        release.set()
        t.join()
        ok = child_exits(pid)
        print(f"{what}={ok}", flush=True)
        return ok

    ok = all([fork_while(lifecycle._lock, "LIFECYCLE"), fork_while(rdt_context._context_lock, "RDT_CONTEXT"),
              fork_while(rt_context._process_context_lock, "GROUP_CONTEXT"), fork_while(transports._lock, "TRANSPORTS"),
              fork_while(shares._uuid_lock, "CUDA_UUIDS")])
    sys.exit(0 if ok else 3)
    """
)


def test_a_child_forked_while_another_thread_holds_an_rdt_lock_still_works(tmp_path):
    """Before: a child forked while another thread held one of rdt's process-wide locks (registering an exit
    stopper, building the context, importing a transport) inherited it held and hung at its first use of rdt
    (18 of 30 children of a busy parent hung in the lifecycle's fork hook itself). Each lock is now made anew in
    the child."""
    script = tmp_path / "fork_locked.py"
    script.write_text(_FORK_WHILE_LOCKED_SCRIPT)
    proc = _run([str(script)], timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert all(f"{w}=True" in out for w in ("LIFECYCLE", "RDT_CONTEXT", "GROUP_CONTEXT", "TRANSPORTS",
                                                    "CUDA_UUIDS")), out


_KILLED_PRODUCER_WITH_A_CHILD = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    from rdt._control.server import ControlServer
    from rdt._process.context import get_context

    r, w = os.pipe()
    producer = os.fork()
    if producer == 0:  # a producer with a control server forks an idle child (a DataLoader worker), then is killed
        ctx = get_context()
        ctx._server = ControlServer("127.0.0.1", ctx._key_for, ctx.control_handlers())
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        os.write(w, f"{ctx._server.address} {child}\\n".encode())
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(w)
    address, child = os.read(r, 200).decode().split()
    os.waitpid(producer, 0)
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print("REFUSED=False", flush=True)
    except ConnectionRefusedError:
        print("REFUSED=True", flush=True)
    except OSError as e:
        print(f"REFUSED=False ({e})", flush=True)
    os.kill(int(child), signal.SIGKILL)
    """
)


def test_a_killed_producers_control_port_is_refused_although_its_forked_child_lives(tmp_path):
    """Before: a child the producer forked inherited its control server's listening socket, so once the producer
    was killed its port still accepted connections while the child lived: a consumer's liveness probe, which
    counts a refused connection as death, saw a silent producer instead and waited out its deadline. The child
    now closes the inherited sockets (never shutting them down, which would reach the parent's)."""
    script = tmp_path / "killed_producer.py"
    script.write_text(_KILLED_PRODUCER_WITH_A_CHILD)
    proc = _run([str(script)], timeout=120)
    assert "REFUSED=True" in proc.stdout, proc.stdout + proc.stderr[-3000:]


_EXIT_WITH_A_READ_IN_FLIGHT = textwrap.dedent(
    """
    import os, secrets, threading, time
    os.environ["UCX_TLS"] = "tcp"  # a READ moves only while the producer's agent progresses
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from tests._bare_context import BareContext
    from rdt._objects.flatten import flatten
    from rdt._objects.table import Entry
    from rdt.transports.nixl import export as nixl_export, read as nixl_read

    producer, consumer = BareContext(), BareContext()
    entry = Entry(secrets.token_bytes(16), flatten(torch.full((1 << 20,), 3.0)), "nixl")
    nixl_export.register(producer, entry)
    info = entry.exports["nixl"][1]
    nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0)  # connected
    stall = threading.Event()

    def hold():  # the producer stops progressing: the next READ waits
        with producer.nixl.lock:
            stall.wait(120)

    threading.Thread(target=hold, daemon=True).start()
    time.sleep(0.1)
    pool = ThreadPoolExecutor(1)  # as rdt.get of several refs and get_async run fetches: joined at exit
    pool.submit(nixl_read.read_object, consumer, info, torch.device("cpu"), 90.0)
    time.sleep(0.5)
    print("EXITING", flush=True)
    """
)


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
def test_exit_does_not_wait_out_a_fetch_in_flight(tmp_path):
    """Before: a process exiting while a NIXL READ of its waited on a stuck producer sat out the READ's whole
    timeout (90 s here) in the interpreter's join of the fetching thread. At exit the wait gives up at once (the
    READ is parked as at a timeout); the exit takes the bounded joins of the stuck threads, seconds."""
    script = tmp_path / "exit_inflight.py"
    script.write_text(_EXIT_WITH_A_READ_IN_FLIGHT)
    start = time.monotonic()
    proc = _run([str(script)], timeout=150)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "EXITING" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert took < 45, f"the exit took {took:.0f} s"
    # Only the producer's progress thread, held on its agent's lock by the test, outlives the exit hook: the
    # consumer's agent, which nobody closed, was stopped too (before, it went on calling into NIXL while the
    # interpreter finalized and aborted the process now and then under load).
    left = [line for line in proc.stderr.splitlines() if "threads still running at exit" in line]
    assert left and left[-1].endswith(": rdt-nixl-progress"), proc.stderr[-3000:]


_STALLED_STREAM_PRODUCER = textwrap.dedent(
    """
    import secrets, sys
    import torch
    from rdt._control.server import ControlServer
    from rdt._objects.flatten import flatten
    from rdt._objects.table import Entry
    from rdt._process.context import get_context

    ctx = get_context()
    # The control server a producer starts on first use (its Ray identity aside), serving this process's objects.
    ctx._server = ControlServer("127.0.0.1", ctx._key_for, ctx.control_handlers())
    obj_id = secrets.token_bytes(16)
    ctx.table.add(Entry(obj_id, flatten(torch.ones(64 << 18)), "auto"))  # 64 MiB: far more than socket buffers
    print(f"READY {ctx._server.address} {ctx.process_key.hex()} {obj_id.hex()}", flush=True)
    sys.stdin.readline()  # the consumer stopped reading mid-stream: now exit normally
    print("EXITING", flush=True)
    """
)


def test_producer_exits_promptly_while_a_consumer_stalls_mid_stream(tmp_path):
    """A consumer that asked for an object's bytes (with the longest deadline) and stopped reading leaves the
    producer's stream thread blocked in ``sendall``; the producer still exits within seconds, not at the deadline."""
    import socket
    import struct
    import time

    from rdt._control import wire as _control
    from rdt.transports.object_store import REQ_FETCH_BYTES

    script = tmp_path / "stalled_stream_producer.py"
    script.write_text(_STALLED_STREAM_PRODUCER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sock = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), line + proc.stderr.read()
        address, key_hex, obj_hex = line.split()[1:]
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        payload = bytes.fromhex(obj_hex) + struct.pack("!I", 3_600_000)  # stream for up to an hour
        sock.sendall(_control.encode(REQ_FETCH_BYTES, _control.KEY_PROCESS, bytes.fromhex(key_hex),
                                     payload))
        _control.read_frame(sock)  # the answer; the object's bytes follow and are never read
        sock.recv(1 << 16)
        time.sleep(1.0)  # the producer's stream thread fills the socket buffers and blocks in sendall
        start = time.monotonic()
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the producer did not exit within 20 s while a consumer stalled mid-stream")
        took = time.monotonic() - start
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{err[-3000:]}"
        assert "EXITING" in out and took < 10.0, (took, out, err[-2000:])
    finally:
        if sock is not None:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
