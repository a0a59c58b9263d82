"""How a consumer names itself to a producer's fence (``versions.who``): a forked child names its own pid, not its
parent's (before: the name was kept from the first call, in the parent)."""

from __future__ import annotations

import os

from rdt._consumer.versions import who


def test_a_forked_child_names_its_own_pid() -> None:
    parent = who()
    assert f"pid {os.getpid()}" in parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no atexit hooks of the parent's)
        try:
            os.write(write, who().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 4096).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert f"pid {pid}" in child and f"pid {os.getpid()}" not in child, (parent, child)
