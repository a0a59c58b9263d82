"""Where a run stands: suite k of n, cases done of all, elapsed time and an estimate of the time left.

A terminal gets one progress bar on its last line, redrawn below the log lines; anything else (a CI log, a pipe)
gets plain ``rdt-bench progress:`` lines at each suite's start and end and at most every ``every_s`` seconds
between. The time left weighs each case by a rough cost estimate (a 128 MiB case costs more than a 4 KiB one),
scaled by how fast this machine has gone through the cases finished so far (starting from a prior pace:
rdt-bench's comes from the load average when the run starts, :func:`load_pace`); while a case runs, the time
spent in it counts down its share (:func:`time_left`). The report also keeps what it estimated and what
each case took (:meth:`Progress.record`, saved in the run's JSON), so that the estimate can be checked against what
really remained (:func:`estimate_check`) and the costs refitted. No Ray here: the unit tests drive it with a fake
clock.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, TextIO, Tuple

PRIOR_S = 30.0  # estimated seconds of cases the pace is assumed to be the prior pace over, until the cases done
# outweigh it
LOAD_PACE = 0.8  # prior pace per runnable process per core already there: two default runs on the 2-core reference
# machine (2026-11-29, 1-min load average 10 and 13 at their start) took 4.6 and 4.7x their plan
LINE_EVERY_S = 10.0  # plain lines: at most one per this many seconds between a suite's start and end
TICK_S = 1.0  # terminal: the bar is redrawn this often, so the elapsed time moves during a long case
BAR_WIDTH = 24


@dataclass(frozen=True)
class SuitePlan:
    """One suite's cases, each a key (what the suite marks done) and its estimated cost in seconds."""

    name: str
    cases: Tuple[Tuple[Hashable, float], ...]


def fmt_duration(seconds: float) -> str:
    """45s, 3m05s, 1h02m."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Tracks the plan of a run and reports it on ``stream``; ``write`` prints a log line without breaking the bar."""

    def __init__(self, plan: Sequence[SuitePlan], stream: Optional[TextIO] = None, tty: Optional[bool] = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float = LINE_EVERY_S,
                 prior_pace: float = 1.0, tail_s: float = 0.0) -> None:
        """``tail_s``: the estimated cost of what follows the last case (rdt-bench's shutdown and report), counted
        in the time left until :meth:`finish`."""
        self.plan = list(plan)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self.every_s = every_s
        self._cost: Dict[Hashable, float] = {k: c for s in self.plan for k, c in s.cases}
        self._done: Dict[Hashable, bool] = {}  # key -> whether it ran (False: skipped when its suite ended)
        self.prior_pace = prior_pace
        self.tail_s = tail_s
        self._tail_done = tail_s <= 0
        self._took: List[Tuple[Hashable, float, float]] = []  # (key, estimated cost, seconds since the last event)
        self._events: List[Tuple[float, float, float, float]] = []  # (elapsed, costs done, left, running)
        self._last_event = 0.0  # elapsed at the last suite start or case done
        self._suite = -1
        self._t0 = clock()
        self._last_line = float("-inf")
        self._bar_shown = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ state
    @property
    def cases_total(self) -> int:
        return len(self._cost)

    @property
    def cases_done(self) -> int:
        return len(self._done)

    @property
    def skipped(self) -> int:
        return sum(1 for ran in self._done.values() if not ran)

    def elapsed(self) -> float:
        return self.clock() - self._t0

    def _costs(self) -> Tuple[float, float, float]:
        """(estimated cost of the cases run, of the cases not done yet, of the one running now: the current
        suite's first case not done)."""
        tail = max(self.tail_s, 0.0)
        done = sum(c for k, c in self._cost.items() if self._done.get(k)) + (tail if self._tail_done else 0.0)
        left = sum(c for k, c in self._cost.items() if k not in self._done) + (0.0 if self._tail_done else tail)
        suite = self.plan[self._suite].cases if 0 <= self._suite < len(self.plan) else ()
        current = next((c for k, c in suite if k not in self._done), 0.0)
        if not self._tail_done and len(self._done) == len(self._cost):  # every case done: the tail runs
            current = tail
        return done, left, current

    def pace(self) -> float:
        """This run's seconds per estimated second up to its last finished case (or suite start), pulled towards
        the prior pace while few cases are done."""
        return pace(self._last_event, self._costs()[0], self.prior_pace)

    def time_left(self) -> float:
        """Estimated seconds left: the remaining cases' cost at this run's pace, the running case's counted down
        by the time it has had (:func:`time_left`)."""
        _, left, current = self._costs()
        return time_left(left, current, self.pace(), self.elapsed() - self._last_event)

    def status(self) -> str:
        """suite 2/4 allreduce, cases 37/212 (17%), elapsed 1m12s, about 6m40s left"""
        n = len(self.plan)
        name = self.plan[self._suite].name if 0 <= self._suite < n else "-"
        total = self.cases_total
        pct = 100 * self.cases_done // total if total else 100
        skipped = f" ({self.skipped} skipped)" if self.skipped else ""
        return (f"suite {max(self._suite, 0) + 1}/{n} {name}, cases {self.cases_done}/{total} ({pct}%){skipped}, "
                f"elapsed {fmt_duration(self.elapsed())}, about {fmt_duration(self.time_left())} left")

    def bar(self, columns: int) -> str:
        """The terminal line: a bar, then the status, cut to ``columns``."""
        total = self.cases_total
        filled = BAR_WIDTH * self.cases_done // total if total else BAR_WIDTH
        return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.status()}"[:max(columns - 1, 0)]

    # ------------------------------------------------------------------ events
    def start_suite(self, name: str) -> None:
        """The suite ``name`` of the plan begins."""
        with self._lock:
            self._suite = next(i for i, s in enumerate(self.plan) if s.name == name)
            self._event()
            self._report(force=True)

    def done(self, *keys: Hashable) -> None:
        """These cases are finished (measured or failed); keys already done or not in the plan are ignored."""
        with self._lock:
            new = [k for k in keys if k in self._cost and k not in self._done]
            now = self.elapsed()
            for i, k in enumerate(new):
                self._done[k] = True  # several keys at once: the time is the first one's
                self._took.append((k, self._cost[k], now - self._last_event if i == 0 else 0.0))
            if new:
                self._event()
                self._report(force=False)

    def _event(self) -> None:
        self._last_event = self.elapsed()
        self._events.append((self._last_event, *self._costs()))

    def record(self) -> Dict[str, Any]:
        """What the report estimated and what happened, for the run's JSON: every case done with its estimated
        cost and the seconds since the event before it (suite start or case done: setup between cases counts to
        the next case); (elapsed, cost done, cost left, cost of the case running) at every event, from which
        :func:`estimate_at` gives the estimate shown at any moment; the prior pace."""
        with self._lock:
            return {"cases": [{"case": "/".join(str(x) for x in (k if isinstance(k, tuple) else (k,))),
                               "estimate_s": round(c, 3), "seconds": round(t, 3)} for k, c, t in self._took],
                    "events": [[round(x, 3) for x in ev] for ev in self._events],
                    "prior_pace": self.prior_pace, "prior_s": PRIOR_S, "tail_s": self.tail_s,
                    "elapsed_s": round(self.elapsed(), 2)}

    def finish_suite(self) -> None:
        """The current suite ended: its cases not marked done did not run (a failure skipped them)."""
        with self._lock:
            if 0 <= self._suite < len(self.plan):
                for k, _ in self.plan[self._suite].cases:
                    self._done.setdefault(k, False)
            self._event()
            self._report(force=True)

    def finish(self) -> None:
        """What follows the last case (the tail) is done too: the time left is 0, said on one last line."""
        with self._lock:
            if not self._tail_done:
                self._tail_done = True
                self._event()
                self._report(force=True)

    def write(self, msg: str) -> None:
        """One log line; on a terminal the bar is cleared first and drawn again under it."""
        with self._lock:
            if self.tty and self._bar_shown:
                self.stream.write("\r\x1b[K")
            self.stream.write(msg + "\n")
            if self.tty and self._suite >= 0:
                self._draw()
            self.stream.flush()

    def _report(self, force: bool) -> None:
        if self.tty:
            self._draw()
        elif force or self.clock() - self._last_line >= self.every_s:
            self.stream.write(f"rdt-bench progress: {self.status()}\n")
            self._last_line = self.clock()
        self.stream.flush()

    def _draw(self) -> None:
        self.stream.write("\r\x1b[K" + self.bar(shutil.get_terminal_size().columns))
        self._bar_shown = True

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "Progress":
        global _active
        _active = self
        if self.tty:
            self._ticker = threading.Thread(target=self._tick, name="rdt-bench-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2 * TICK_S)
        with self._lock:
            if self.tty and self._bar_shown:
                self.stream.write("\n")  # leave the last bar on screen
                self._bar_shown = False
                self.stream.flush()
        if _active is self:
            _active = None

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                if self._suite >= 0 and not self._stop.is_set():
                    self._draw()
                    self.stream.flush()


def pace(elapsed: float, cost_done: float, prior_pace: float = 1.0, prior_s: float = PRIOR_S) -> float:
    """Seconds per estimated second: the time so far over the cost of the cases done, with ``prior_s`` estimated
    seconds at ``prior_pace`` added to both."""
    return (elapsed + prior_s * prior_pace) / (cost_done + prior_s)


OVERRUN = 0.5  # a running case is expected to go on for at least this fraction of the time it has had


def time_left(left: float, current: float, run_pace: float, since: float) -> float:
    """``left`` estimated seconds of cases at ``run_pace``, of which the running one (``current``) has had
    ``since`` seconds: the cases after it, plus the larger of its expected time less ``since`` and OVERRUN x
    ``since`` (a case near or past its expected time goes on for a while). Replayed over four loaded default runs,
    this was within 30 % of what remained more often than counting the running case whole."""
    if current <= 0:
        return left * run_pace
    return (left - current) * run_pace + max(current * run_pace - since, OVERRUN * since)


def load_pace(load: float, cores: int) -> float:
    """The prior pace on a machine whose load average (runnable processes) is ``load`` before the run starts: 1
    where it has a core to spare, LOAD_PACE per process per core above that."""
    return max(1.0, LOAD_PACE * load / max(cores, 1))


def estimate_at(record: Dict[str, Any], t: float) -> Optional[float]:
    """The time left the report showed ``t`` seconds into the run (a terminal's bar is redrawn every second), from
    :meth:`Progress.record`; None before its first event."""
    made = [ev for ev in record.get("events", []) if ev[0] <= t]
    if not made:
        return None
    e, done, left, current = made[-1]
    run_pace = pace(e, done, record.get("prior_pace", 1.0), record.get("prior_s", PRIOR_S))
    return time_left(left, current, run_pace, t - e)


def estimate_check(record: Dict[str, Any], end_s: float,
                   at: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9)) -> List[Dict[str, float]]:
    """The time-left estimate against what really remained: at each fraction of the run (``end_s``: seconds from
    the report's start to the run's end), the estimate shown then, the seconds that remained, and their ratio
    (1.0: exact; above: too long)."""
    out: List[Dict[str, float]] = []
    for frac in at:
        t = frac * end_s
        left = estimate_at(record, t)
        if left is None or end_s - t <= 0:
            continue
        out.append({"at": frac, "elapsed_s": round(t, 1), "estimate_s": round(left, 1),
                    "remaining_s": round(end_s - t, 1), "ratio": round(left / (end_s - t), 2)})
    return out


_active: Optional[Progress] = None


def emit(msg: str) -> None:
    """A log line of the run: through the active progress report, else straight to stderr."""
    if _active is not None:
        _active.write(msg)
    else:
        print(msg, file=sys.stderr, flush=True)
