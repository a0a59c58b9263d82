"""A Ray cluster across network namespaces on one machine, joined by rate-shaped veth links (issue 15); used by
the netns tests (tests/netns_cases.py) and the cross-node benchmark (``rdt-bench --suites xnode``).

Layout: a bridge ``rdtbr0`` (10.77.0.1/24, the driver's and the Ray head's address) and one namespace ``rdt-nK``
per worker node, joined to the bridge by a veth pair (``rdtvK`` on the host, ``rdtvKp`` inside, 10.77.0.1K).
Both ends carry a ``tbf`` qdisc (the host end shapes traffic into the node, the inner end traffic out of it), so
``tc -s`` byte counters prove that bytes crossed a link. No default route, no NAT: nothing leaves the machine.

Every name is fixed, so ``cleanup()`` removes the leftovers of a crashed earlier run before a new cluster starts.
Ray processes run under our own sessions (``start_new_session``) and are stopped by killing those process groups;
nothing here ever runs ``ray stop``.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

BRIDGE = "rdtbr0"
PREFIX = "10.77.0"
HOST_IP = f"{PREFIX}.1"
NS_PREFIX = "rdt-n"
VETH_PREFIX = "rdtv"
RATE = "2gbit"
TEMP_DIR = "/tmp/rdt-netns-ray"
PIDS_FILE = os.path.join("/tmp", "rdt-netns-pgids")  # process groups we started, for the next run's cleanup
LOCK_FILE = os.path.join("/tmp", "rdt-netns.lock")  # held while a cluster lives: the names are machine-wide
CMD_TIMEOUT = 20.0
# Bytes of headers per packet on these links: Ethernet 14 + IPv4 20 + TCP 20 + its timestamp option 12 (Linux's
# default); everything the nodes exchange is TCP (Ray's gRPC, Gloo, UCX's tcp transport).
FRAME_HEADER = 66
MiB = 1 << 20


def _run(*args: str, check: bool = True, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command with a timeout; raise with its stderr when ``check`` and it fails."""
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def unavailable_reason() -> Optional[str]:
    """Why the simulated cluster cannot run here (None when it can): it needs root, ``ip`` and ``tc``."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run the netns tests as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


@dataclass
class Node:
    """One worker node: its namespace, veth ends, address, and the Ray process group running in it."""

    index: int
    ns: str
    host_veth: str
    ns_veth: str
    ip: str
    resource: str
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    def exec(self, *args: str) -> List[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def counters(self) -> Dict[str, int]:
        """Bytes the shaped link carried so far: ``into`` the node (host end) and ``out`` of it (inner end)."""
        return {"into": _qdisc_bytes(["tc"], self.host_veth), "out": _qdisc_bytes(self.exec("tc"), self.ns_veth)}

    def out_stats(self) -> Dict[str, int]:
        """Bytes and packets (segments) out of the node so far, and the payload those bytes carried: each packet's
        Ethernet, IPv4 and TCP headers (``FRAME_HEADER``) taken off."""
        nbytes, packets = _qdisc_stats(self.exec("tc"), self.ns_veth)
        return {"bytes": nbytes, "packets": packets, "payload": nbytes - packets * FRAME_HEADER}

    def link(self, up: bool) -> None:
        """Cut (``up=False``) or restore the node's link at its host end; the inner end sees the carrier go."""
        _run("ip", "link", "set", self.host_veth, "up" if up else "down")


    def remove(self) -> None:
        """Take the node away as a crash would: kill every process in its namespace, then delete its link.

        (Deleting a namespace alone stops nothing: its processes keep it alive.)"""
        if self.proc is not None and self.proc.poll() is None:
            _kill(self.proc.pid, group=True)
        for pid in _run("ip", "netns", "pids", self.ns, check=False).stdout.split():
            _kill(int(pid), group=False)
        _run("ip", "link", "del", self.host_veth, check=False)


def _qdisc_bytes(tc: List[str], dev: str) -> int:
    return _qdisc_stats(tc, dev)[0]


def _qdisc_stats(tc: List[str], dev: str) -> Tuple[int, int]:
    """(bytes, packets) the root qdisc of ``dev`` passed; the kernel counts a segmentation-offloaded packet as
    its segments, each with its own headers, as they go on the wire."""
    qdiscs = [q for q in json.loads(_run(*tc, "-s", "-j", "qdisc", "show", "dev", dev).stdout) if q.get("root")]
    return sum(int(q.get("bytes", 0)) for q in qdiscs), sum(int(q.get("packets", 0)) for q in qdiscs)


def _free_port() -> int:
    """A port free on every address of the host namespace (the dashboard binds 127.0.0.1, the rest the bridge)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def cleanup() -> None:
    """Remove everything a run of this harness creates (idempotent; safe when nothing exists)."""
    _kill_recorded_groups()
    for ns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(NS_PREFIX):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                _kill(int(pid), group=False)
            _run("ip", "netns", "del", name, check=False)
    links = json.loads(_run("ip", "-j", "link", "show", check=False).stdout or "[]")
    for link in links:
        name = link.get("ifname", "")
        if name == BRIDGE or (name.startswith(VETH_PREFIX) and name[len(VETH_PREFIX):].rstrip("p").isdigit()):
            _run("ip", "link", "del", name, check=False)


def leftovers(pgids: List[int]) -> List[str]:
    """What of a run is still there: namespaces, links, live process groups among ``pgids`` (empty when clean)."""
    left = [n.split(" ")[0] for n in _run("ip", "netns", "list", check=False).stdout.split("\n")
            if n.startswith(NS_PREFIX)]
    links = json.loads(_run("ip", "-j", "link", "show", check=False).stdout or "[]")
    left += [x["ifname"] for x in links if x.get("ifname", "").startswith((BRIDGE, VETH_PREFIX))]
    return left + [f"process group {g}" for g in _live_groups(pgids)]


def _live_groups(pgids: List[int]) -> List[int]:
    live = []
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            live.append(pgid)
        except ProcessLookupError:
            pass
    return live


def _kill(pid: int, *, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_recorded_groups() -> None:
    try:
        with open(PIDS_FILE) as f:
            pgids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return
    for pgid in pgids:
        _kill(pgid, group=True)
    os.unlink(PIDS_FILE)


def _record(pgid: int) -> None:
    with open(PIDS_FILE, "a") as f:
        f.write(f"{pgid}\n")


def create_network(n: int) -> List[Node]:
    """The bridge and ``n`` shaped namespaces (call ``cleanup()`` first)."""
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    nodes = []
    for k in range(1, n + 1):
        node = Node(k, f"{NS_PREFIX}{k}", f"{VETH_PREFIX}{k}", f"{VETH_PREFIX}{k}p", f"{PREFIX}.{10 + k}", f"n{k}")
        _run("ip", "netns", "add", node.ns)
        _run("ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", node.ns_veth)
        _run("ip", "link", "set", node.ns_veth, "netns", node.ns)
        _run("ip", "link", "set", node.host_veth, "master", BRIDGE, "up")
        _run(*node.exec("ip", "addr", "add", f"{node.ip}/24", "dev", node.ns_veth))
        _run(*node.exec("ip", "link", "set", node.ns_veth, "up"))
        _run(*node.exec("ip", "link", "set", "lo", "up"))
        shape = ("qdisc", "add", "dev")
        tbf = ("root", "tbf", "rate", RATE, "burst", "1mb", "latency", "50ms")
        _run("tc", *shape, node.host_veth, *tbf)
        _run(*node.exec("tc", *shape, node.ns_veth, *tbf))
        nodes.append(node)
    return nodes


def _node_env(ifname: str) -> Dict[str, str]:
    """Env of one Ray node (its workers inherit it): every transport on that node's own interface.

    The namespaces share one kernel, so UCX (and NIXL over it) would otherwise reach a peer in another namespace
    through shared memory or CMA; ``UCX_TLS=tcp`` makes it use the network, as it must between real hosts."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("RAY_ADDRESS", "RDT_TCP_HOST", "RDT_UCX_HOST")):
            del env[k]
    env.update({"GLOO_SOCKET_IFNAME": ifname, "UCX_NET_DEVICES": ifname, "UCX_TLS": "tcp,self",
                "UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # `ray start` refuses to join a node otherwise
                # like the suite's local clusters: no Ray token auth (`ray start` would otherwise turn it on when
                # ~/.ray/auth_token exists, and the driver's ray.init would be refused)
                "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"})
    return env


def _ray_start(name: str, prefix: List[str], args: List[str], env: Dict[str, str]) -> subprocess.Popen:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [*prefix, ray, "start", "--block", "--disable-usage-stats", f"--temp-dir={TEMP_DIR}", *args]
    log = open(os.path.join(TEMP_DIR, f"start-{name}.log"), "wb")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _record(p.pid)
    return p


def _wait_started(proc: subprocess.Popen, name: str, timeout: float) -> None:
    """Wait until ``ray start --block`` for ``name`` says its node is up (or fail with its log's path)."""
    path = os.path.join(TEMP_DIR, f"start-{name}.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Ray node {name} exited ({proc.returncode}); see {path}")
        with open(path, "rb") as f:
            if b"will now block forever" in f.read():
                return
        time.sleep(0.2)
    raise TimeoutError(f"the Ray node {name} did not start within {timeout:.0f} s; see {path}")


class NetnsCluster:
    """A Ray head on the bridge plus one Ray node per namespace; ``address`` for ``ray.init``."""

    def __init__(self, n_nodes: int = 2, *, object_store_mib: int = 160, head_resources: str = "head") -> None:
        self.n_nodes = n_nodes
        self.object_store = object_store_mib * MiB
        self.head_resource = head_resources
        self.nodes: List[Node] = []
        self.head: Optional[subprocess.Popen] = None
        self.address = ""
        self._lock_fd: Optional[int] = None

    def start(self, *, timeout: float = 120.0, lock_timeout: float = 180.0) -> "NetnsCluster":
        self._lock(lock_timeout)
        cleanup()
        atexit.register(self.stop)  # also when the test process ends without running the fixture's finally
        shutil.rmtree(TEMP_DIR, ignore_errors=True)  # the last run's logs (kept after stop() for a post-mortem)
        os.makedirs(TEMP_DIR, exist_ok=True)
        self.nodes = create_network(self.n_nodes)
        port = _free_port()
        self.address = f"{HOST_IP}:{port}"
        system_config = json.dumps({"health_check_period_ms": 1000, "health_check_failure_threshold": 20})
        self.head = _ray_start("head", [], [
            "--head", f"--node-ip-address={HOST_IP}", f"--port={port}", "--num-cpus=0",
            f"--resources={json.dumps({self.head_resource: 8})}", f"--object-store-memory={self.object_store}",
            "--include-dashboard=false", f"--dashboard-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}", f"--metrics-export-port={_free_port()}",
            f"--system-config={system_config}"], _node_env(BRIDGE))
        self._wait_port(port, timeout)
        for node in self.nodes:
            node.proc = _ray_start(node.ns, node.exec(), [
                f"--address={self.address}", f"--node-ip-address={node.ip}", "--num-cpus=1",
                f"--resources={json.dumps({node.resource: 8})}", f"--object-store-memory={self.object_store}"],
                _node_env(node.ns_veth))
            # one at a time: nodes sharing the temp dir would otherwise race for the same socket name "raylet.1"
            _wait_started(node.proc, node.ns, timeout)
        return self

    def _lock(self, timeout: float) -> None:
        """Hold the machine-wide lock (a second test run waits for the first; the kernel frees it if we die),
        so that ``cleanup()`` only ever removes a crashed run's leftovers, never a live cluster."""
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"another process held {LOCK_FILE} (a running netns cluster) for "
                                       f"{timeout:.0f} s; wait for it to finish, or run the netns tests alone")
                time.sleep(0.5)

    def _wait_port(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.head is not None and self.head.poll() is not None:
                raise RuntimeError(f"the Ray head exited ({self.head.returncode}); see {TEMP_DIR}/start-head.log")
            try:
                socket.create_connection((HOST_IP, port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"the Ray head at {HOST_IP}:{port} did not listen within {timeout:.0f} s")

    def wait_for_nodes(self, ray_module, *, timeout: float = 120.0) -> None:
        """Wait (driver connected) until the head and every namespace node are alive in Ray."""
        deadline = time.monotonic() + timeout
        want = {HOST_IP, *(n.ip for n in self.nodes)}
        while time.monotonic() < deadline:
            alive = {n["NodeManagerAddress"] for n in ray_module.nodes() if n["Alive"]}
            if want <= alive:
                return
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"the Ray node in {node.ns} exited ({node.proc.returncode}); "
                                       f"see {TEMP_DIR}/start-{node.ns}.log")
            time.sleep(0.5)
        raise TimeoutError(f"Ray nodes {sorted(want - alive)} did not join within {timeout:.0f} s")

    def pgids(self) -> List[int]:
        return [p.pid for p in [self.head, *(n.proc for n in self.nodes)] if p is not None]

    def stop(self) -> None:
        """Kill every Ray process group we started, then remove the network (idempotent; a no-op unless this
        cluster holds the lock, so a late call can never remove another run's cluster)."""
        if self._lock_fd is None:
            return
        for p in [*(n.proc for n in self.nodes), self.head]:
            if p is not None and p.poll() is None:
                _kill(p.pid, group=True)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        deadline = time.monotonic() + 15  # the groups' other members die (and are reaped) a moment later
        while _live_groups(self.pgids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        cleanup()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
