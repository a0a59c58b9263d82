"""How long a waiter busy-polls before it sleeps: long on a quiet machine, briefly on a busy one.

A sleeping waiter's wake-up queues behind whatever runs on its core, so on a quiet machine polling through a
short transfer beats sleeping; on a busy one both ends of a transfer polling steal the CPU each needs. Measured on
the 2-core machine (rdt-bench p2p, interleaved rounds in the same two actors, 2026-11-26):

- NIXL, 1 MiB back to back: 200 us of polling 208-275 us or (4 samples in 10) 474-849 us; 1 ms 219-268 us.
- UCX, 4 KiB back to back / after a barrier: 30 us 201-324 / 175-180 us; 1 ms 133-141 / 142-149 us.
- Busy (load 5.7-12, NIXL 4 KiB-1 MiB): 20 us of polling 349-572 us, 200 us 692-864 us, 1 ms worse still.

The load average is read at most once a second; "busy" is above 2 runnable tasks per core.
"""

from __future__ import annotations

import os
import time
from typing import List

QUIET_S = 1e-3
BUSY_LOAD_PER_CORE = 2.0
RECHECK_S = 1.0

_state: List[float] = [0.0, float("-inf")]  # busy (0 or 1), when the load was read (monotonic)


def busy(now: float) -> bool:
    """Whether the 1-minute load average is above BUSY_LOAD_PER_CORE per core (re-read at most once a second)."""
    flag, checked = _state
    if now - checked < RECHECK_S:
        return bool(flag)
    try:
        is_busy = os.getloadavg()[0] > BUSY_LOAD_PER_CORE * (os.cpu_count() or 1)
    except OSError:  # no load average here: assume cores are free
        is_busy = False
    _state[0], _state[1] = float(is_busy), now
    return is_busy


def window(busy_s: float, quiet_s: float = QUIET_S, now: float = -1.0) -> float:
    """How long to poll before sleeping: ``quiet_s`` on a quiet machine, ``busy_s`` on a busy one."""
    return busy_s if busy(time.monotonic() if now < 0 else now) else quiet_s
