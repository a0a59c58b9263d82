"""Process liveness on this node, shared by the transports and the object layer."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a killed process its parent has not reaped yet (zombie) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
