"""Same-node transfer through POSIX shared memory.

The producer copies an object's buffers once into a private (0600) segment with an unguessable name that embeds
its pid; consumers map it copy-on-write (MAP_PRIVATE), so a consumer that writes to its tensors changes only its
own pages, never the producer's or another consumer's. Segments are unlinked when the object is freed, at exit,
and by any later rdt process on the node that finds the owner pid dead.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

SHM_DIR = "/dev/shm"
PREFIX = "rdt-"
ALIGN = 256
_NAME_RE = re.compile(r"rdt-([0-9]+)-[0-9a-f]{32}")  # used with fullmatch: no trailing newline, ASCII digits


@dataclass(frozen=True)
class Segment:
    """A written segment: its name and each buffer's (offset, nbytes)."""

    name: str
    layout: Tuple[Tuple[int, int], ...]
    size: int


def _layout(sizes: Sequence[int]) -> Tuple[Tuple[Tuple[int, int], ...], int]:
    out = []
    off = 0
    for n in sizes:
        out.append((off, n))
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return tuple(out), max(off, 1)


def write_segment(buffers: Sequence[torch.Tensor]) -> Segment:
    """Copy CPU uint8 buffers into a new segment (one copy, done by the kernel's write path)."""
    layout, size = _layout([b.numel() for b in buffers])
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        for (off, n), buf in zip(layout, buffers):
            view = memoryview(buf.numpy()).cast("B")
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], off + done)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    return Segment(name, layout, size)


def map_segment(name: str, layout: Sequence[Tuple[int, int]]) -> List[torch.Tensor]:
    """Map a segment copy-on-write and return one uint8 tensor per buffer (no copy until written)."""
    if not _NAME_RE.fullmatch(name):
        raise FileNotFoundError(f"not an rdt segment name: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    return [whole[off:off + n] for off, n in layout]


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def reap_dead_owners() -> int:
    """Unlink segments whose owner process is gone (it was killed before it could clean up)."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        m = _NAME_RE.fullmatch(name)
        if not m:
            continue
        if not pid_alive(int(m.group(1))):
            unlink(name)
            removed += 1
    return removed


def owner_alive(name: str) -> bool:
    """Whether the process that wrote segment ``name`` still runs (on this node)."""
    m = _NAME_RE.fullmatch(name)
    return bool(m) and pid_alive(int(m.group(1)))


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a killed process its parent has not reaped yet (zombie) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def segments_of(pid: int) -> List[str]:
    """Names of live segments owned by ``pid`` (for tests and stats)."""
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{pid}-")]
    except OSError:
        return []
