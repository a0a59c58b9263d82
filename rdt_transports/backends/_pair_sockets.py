"""Find the TCP sockets of a Gloo group's pairs, so that an abort can shut them down and wake blocked waits.

``ProcessGroupGloo`` exposes neither its sockets nor a way to cancel a pending ``wait()``; a closed connection is
the one thing that ends such a wait at once. The sockets are recognised without touching Gloo's internals: the
sockets this process gained while the group was built (``/proc/self/fd``) that are connected either to this
rank's new listening port or to a listening port a peer published through the group's rendezvous. Exactly one
per peer must be found (Gloo's TCP transport connects a full mesh at creation), otherwise nothing is claimed and
the backend keeps its helper-thread waits. Before shutting a socket down the fd is checked to still be the same
socket (same inode), so a number Gloo closed and the process reused is never touched.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Dict, List, Optional, Set, Tuple

from .base import BackendConfig

logger = logging.getLogger("rdt_transports")

Pair = Tuple[int, int]  # (fd, inode)
_FD_DIR = "/proc/self/fd"


def snapshot() -> Dict[int, int]:
    """inode -> fd of every socket this process has open (empty where /proc is missing)."""
    out: Dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(name)
    return out


def _describe(fd: int) -> Optional[Tuple[bool, int, Optional[int]]]:
    """(listening, local port, remote port) of a TCP socket fd, or None for anything else."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local = s.getsockname()[1]
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return True, local, None
        try:
            return False, local, s.getpeername()[1]
        except OSError:  # not connected
            return None
    except OSError:
        return None
    finally:
        s.close()


def find(before: Dict[int, int], config: BackendConfig) -> Optional[List[Pair]]:
    """This group's pair sockets (one per peer), or None when they cannot be told apart with certainty."""
    if config.world_size < 2:
        return []
    new = {ino: fd for ino, fd in snapshot().items() if ino not in before}
    listening: Set[int] = set()
    connected: List[Tuple[int, int, int, int]] = []  # (fd, inode, local port, remote port)
    for ino, fd in new.items():
        d = _describe(fd)
        if d is None:
            continue
        if d[0]:
            listening.add(d[1])
        else:
            connected.append((fd, ino, d[1], d[2] or 0))
    rdv = config.rendezvous
    try:
        rdv.put(f"gloo-listen/{config.rank}", ",".join(str(p) for p in sorted(listening)).encode())
        theirs: Set[int] = set()
        for r in range(config.world_size):
            if r != config.rank:
                raw = rdv.get(f"gloo-listen/{r}", config.timeout, what=f"rank {r}'s Gloo port").decode()
                theirs.update(int(p) for p in raw.split(",") if p)
    except Exception as e:  # noqa: BLE001 - without the peers' ports, claim nothing
        logger.debug("rdt_transports: group=%s: Gloo pair sockets unknown (%s)", config.group_name, e)
        return None
    pairs = [(fd, ino) for fd, ino, local, remote in connected if local in listening or remote in theirs]
    if len(pairs) != config.world_size - 1:
        logger.debug("rdt_transports: group=%s rank=%d: found %d Gloo pair sockets for %d peers; waits use "
                     "helper threads", config.group_name, config.rank, len(pairs), config.world_size - 1)
        return None
    return pairs


def shut(pairs: List[Pair]) -> None:
    """Shut every still-open pair socket down (both directions); never raises."""
    for fd, ino in pairs:
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") != f"socket:[{ino}]":
                continue  # Gloo closed it (and the number may belong to someone else now)
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
