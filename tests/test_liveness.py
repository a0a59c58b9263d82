"""Liveness of /dev/shm owners across pid namespaces: the reaper keeps a live owner's segments and barrier
semaphores even when its pid means nothing here, and removes them (and its lock file) once it died."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from rdt.transports.shm import segments as _shm
from rdt_transports._proc import pid_alive

from .conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
NS_PID = 3_999_990  # the owner's pid inside its namespace will be NS_PID + 1: no such pid exists out here

_OWNER = r"""
import sys, time, torch
from rdt.transports.shm import segments as _shm
from rdt_transports.backends._shm_barrier import ShmBarrier
seg = _shm.write_segment([torch.ones(4096, dtype=torch.uint8)])
barrier = ShmBarrier("liveness", 0, 2, b"k" * 32)
print(" ".join([seg.name] + ["sem." + n for n in barrier.names]), flush=True)
time.sleep(120)
"""


def _exists(names: List[str]) -> List[bool]:
    return [os.path.exists(os.path.join(_shm.SHM_DIR, n)) for n in names]


def _lock_files(pid: int) -> List[str]:
    return [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(f"rdt.owner-{pid}-")]


def _start(argv: List[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path)})


def _read_names(proc: subprocess.Popen) -> List[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the owner prints once its files exist (bounded: the owner sleeps 120 s)
    assert line.strip(), "the owner process did not start"
    return line.split()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: unshare, its shell and the owner
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_owner_in_another_pid_namespace_is_alive_until_it_dies() -> None:
    script = f"echo {NS_PID} > /proc/sys/kernel/ns_last_pid; {sys.executable} -c \"$0\"; true"
    proc = _start(["unshare", "--pid", "--fork", "sh", "-c", script, _OWNER])
    try:
        names = _read_names(proc)
        pid = int(names[0].split("-")[1])
        assert pid == NS_PID + 1 and not pid_alive(pid)  # by pid, the owner looks dead from here
        assert _shm.owner_alive(names[0])
        _shm.reap_dead_owners()
        assert _exists(names) == [True] * len(names), "the reaper deleted a live owner's files"
        _kill(proc)
        # The kernel drops the owner's lock as it finishes exiting, shortly after its namespace's init is reaped.
        assert wait_for(lambda: not _shm.owner_alive(names[0]), timeout=30)
        _shm.reap_dead_owners()
        assert _exists(names) == [False] * len(names), "a dead owner's files were kept"
        assert not _shm.owner_alive(names[0]) and _lock_files(pid) == []
    finally:
        if proc.poll() is None:
            _kill(proc)
        for n in names if "names" in locals() else []:
            _shm.unlink(n)


def test_sigkilled_owner_files_are_reaped_and_live_ones_kept() -> None:
    proc = _start([sys.executable, "-c", _OWNER])
    mine = _shm.write_segment([])
    try:
        names = _read_names(proc)
        _shm.reap_dead_owners()
        assert _exists(names) == [True] * len(names)
        _kill(proc)
        assert _exists(names) == [True] * len(names)  # SIGKILL: no chance to clean up
        assert wait_for(lambda: not _shm.owner_alive(names[0]), timeout=30)
        _shm.reap_dead_owners()
        assert _exists(names) == [False] * len(names) and _lock_files(proc.pid) == []
        assert _exists([mine.name]) == [True] and _shm.owner_alive(mine.name)  # ours stays
    finally:
        if proc.poll() is None:
            _kill(proc)
        _shm.unlink(mine.name)


_FORKED = r"""
import os, sys, torch
from rdt.transports.shm import segments as _shm
from rdt_transports import _proc
parent = _shm.write_segment([torch.ones(8, dtype=torch.uint8)])
r, w = os.pipe()
child = os.fork()
if child == 0:
    seg = _shm.write_segment([torch.ones(8, dtype=torch.uint8)])  # a forked child takes its own owner lock
    os.write(w, (seg.name + " " + _proc.current_owner_token()).encode())
    os._exit(0)
os.waitpid(child, 0)
name, token = os.read(r, 4096).decode().split()
print(name, token, _proc.current_owner_token(), _shm.owner_alive(parent.name), _shm.owner_alive(name))
_shm.unlink(parent.name); _shm.unlink(name)
_proc.reap_lock(os.path.basename(_proc.lock_path(child, token)))  # the child ran no atexit
"""


def test_a_forked_child_is_its_own_owner_and_leaves_the_parent_alive() -> None:
    out = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    name, child_token, parent_token, parent_alive, child_alive = out.stdout.split()
    assert child_token != parent_token and child_token in name
    # The child exited (its os._exit ran no atexit): its lock is free, the parent's (inherited fd) still held.
    assert (parent_alive, child_alive) == ("True", "False")
