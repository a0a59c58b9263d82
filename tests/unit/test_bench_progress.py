"""rdt-bench's progress report (benchmarks/_progress.py): counts, the time-left estimate, the plain-line format and
its pacing, the terminal bar around log lines. A fake clock and a string stream; no Ray."""

from __future__ import annotations

import io
import re

from benchmarks._progress import PRIOR_S, Progress, SuitePlan, fmt_duration

LINE = re.compile(r"^rdt-bench progress: suite (\d+)/(\d+) (\S+), cases (\d+)/(\d+) \((\d+)%\)( \(\d+ skipped\))?, "
                  r"elapsed (\S+), about (\S+) left$")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _plan() -> list:
    return [SuitePlan("p2p", (("a", 10.0), ("b", 30.0))), SuitePlan("objects", (("c", 60.0),))]


def _lines(out: io.StringIO) -> list:
    return [ln for ln in out.getvalue().splitlines() if ln.startswith("rdt-bench progress:")]


def test_fmt_duration() -> None:
    assert [fmt_duration(s) for s in (0, 44.6, 60, 185, 3599, 3720)] == ["0s", "45s", "1m00s", "3m05s", "59m59s",
                                                                          "1h02m"]


def test_time_left_is_the_remaining_cost_at_this_runs_pace() -> None:
    clock = Clock()
    p = Progress(_plan(), stream=io.StringIO(), tty=False, clock=clock)
    assert p.cases_total == 3 and p.cases_done == 0
    assert p.time_left() == 100.0  # nothing done, nothing elapsed: the estimates as they are
    p.start_suite("p2p")
    clock.t += 2 * (10.0 + PRIOR_S) - PRIOR_S  # "a" took twice its estimate
    p.done("a")
    assert p.cases_done == 1
    assert abs(p.time_left() - 90.0 * 2) < 1e-9  # the 90 estimated seconds left, at pace 2
    p.done("a", "not-in-the-plan")  # repeated and unknown keys change nothing
    assert p.cases_done == 1


def test_plain_lines_format_and_pacing() -> None:
    clock, out = Clock(), io.StringIO()
    p = Progress(_plan(), stream=out, tty=False, clock=clock, every_s=10.0)
    p.start_suite("p2p")  # a suite's start always gets a line
    clock.t += 1
    p.done("a")  # 1 s after the last line: none
    clock.t += 65
    p.write("p2p rdt-gloo 4 KiB ...")  # log lines go through unchanged, no escape codes
    p.done("b")  # 66 s after: a line
    p.finish_suite()  # a suite's end always gets a line
    lines = _lines(out)
    assert len(lines) == 3, out.getvalue()
    m = [LINE.match(ln) for ln in lines]
    assert all(m), lines
    assert m[0].groups()[:6] == ("1", "2", "p2p", "0", "3", "0")
    assert m[1].groups()[:6] == ("1", "2", "p2p", "2", "3", "66")
    assert m[1].group(8) == "1m06s"
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
    assert "p2p rdt-gloo 4 KiB ...\n" in out.getvalue()


def test_a_suite_that_ends_early_counts_its_rest_as_skipped() -> None:
    clock, out = Clock(), io.StringIO()
    p = Progress(_plan(), stream=out, tty=False, clock=clock)
    p.start_suite("p2p")
    clock.t += 20
    p.done("a")
    p.finish_suite()  # "b" never ran (its case failed)
    assert (p.cases_done, p.skipped) == (2, 1)
    assert LINE.match(_lines(out)[-1]).group(7) == " (1 skipped)"
    p.start_suite("objects")
    assert LINE.match(_lines(out)[-1]).groups()[:3] == ("2", "2", "objects")
    # the skipped case weighs nothing: the pace is that of "a" alone, (20 + PRIOR_S) / (10 + PRIOR_S)
    expected = 60.0 * (20 + PRIOR_S) / (10 + PRIOR_S)
    assert abs(p.time_left() - expected) < 1e-9


def test_a_running_case_counts_down_then_overruns() -> None:
    """While "c" runs, the time it has had comes off its share, but it is expected to go on for at least OVERRUN x
    the time it has had (near or past its expected time)."""
    from benchmarks._progress import OVERRUN

    clock = Clock()
    p = Progress(_plan(), stream=io.StringIO(), tty=False, clock=clock)
    p.start_suite("p2p")
    clock.t += 80 + PRIOR_S  # "a" and "b" (40 estimated seconds) at pace 2, the prior included
    p.done("a", "b")
    p.finish_suite()
    p.start_suite("objects")
    assert p.time_left() == 120.0
    clock.t += 20
    assert p.time_left() == 100.0
    clock.t += 180
    assert p.time_left() == OVERRUN * 200
    p.done("c")
    assert p.time_left() == 0.0


def test_terminal_bar_redrawn_under_log_lines() -> None:
    out = io.StringIO()
    p = Progress(_plan(), stream=out, tty=True, clock=Clock())
    p.start_suite("p2p")
    p.done("a")
    p.write("a log line")
    text = out.getvalue()
    assert "rdt-bench progress:" not in text  # no plain lines on a terminal
    before, after = text.split("a log line\n")
    assert before.endswith("\r\x1b[K")  # the bar was cleared before the line
    assert after.startswith("\r\x1b[K[") and "cases 1/3" in after  # and drawn again under it
    assert p.bar(40) == p.bar(40)[:39] and len(p.bar(40)) == 39  # cut to the terminal's width
    assert p.bar(200).startswith("[" + "#" * 8 + "." * 16 + "] suite 1/2 p2p, cases 1/3")


def test_emit_goes_through_the_active_report(capsys) -> None:
    from benchmarks import _progress

    out = io.StringIO()
    with Progress(_plan(), stream=out, tty=False, clock=Clock()):
        _progress.emit("inside")
    _progress.emit("outside")
    assert out.getvalue() == "inside\n"
    assert capsys.readouterr().err == "outside\n"


def test_record_keeps_each_cases_time_and_every_estimate() -> None:
    """record(): each case with its estimated cost and the seconds since the event before it (a suite's start or
    the case before), and the costs done and left at every event, from which estimate_at() gives the estimate shown
    at any moment; estimate_check() compares those with what really remained."""
    from benchmarks._progress import estimate_at, estimate_check

    clock = Clock()
    p = Progress(_plan(), stream=io.StringIO(), tty=False, clock=clock)
    p.start_suite("p2p")
    clock.t += 12
    p.done("a")
    clock.t += 28
    p.done("b")
    p.finish_suite()
    p.start_suite("objects")
    clock.t += 20
    shown = p.time_left()  # mid-case: what the bar shows now
    clock.t += 40
    p.done("c", "a")  # "a" again: not counted twice
    rec = p.record()
    assert [(c["case"], c["estimate_s"], c["seconds"]) for c in rec["cases"]] == [("a", 10.0, 12.0),
                                                                                 ("b", 30.0, 28.0),
                                                                                 ("c", 60.0, 60.0)]
    assert [e[0] for e in rec["events"]] == [0.0, 12.0, 40.0, 40.0, 40.0, 100.0]
    assert rec["events"][0] == [0.0, 0.0, 100.0, 10.0] and rec["events"][-1] == [100.0, 100.0, 0.0, 0.0]
    assert estimate_at(rec, -1.0) is None and estimate_at(rec, 0.0) == 100.0
    assert abs(estimate_at(rec, 60.0) - shown) < 1e-9
    check = estimate_check(rec, 100.0, at=(0.0, 0.6, 1.0))
    assert [c["at"] for c in check] == [0.0, 0.6]  # nothing remained at the end: no ratio there
    assert check[0] == {"at": 0.0, "elapsed_s": 0.0, "estimate_s": 100.0, "remaining_s": 100.0, "ratio": 1.0}
    assert check[1]["remaining_s"] == 40.0 and check[1]["ratio"] == round(shown / 40.0, 2)
    assert abs(p.pace() - 1.0) < 1e-9  # 100 s for 100 estimated seconds


def test_prior_pace_from_the_load_average() -> None:
    """A busy machine starts from a slower pace (load_pace: 1 up to about a process per core); the cases done
    outweigh it as the run goes."""
    from benchmarks._progress import LOAD_PACE, load_pace

    assert load_pace(0.3, 2) == load_pace(2.0, 2) == 1.0
    assert abs(load_pace(12.0, 2) - 6 * LOAD_PACE) < 1e-9
    clock = Clock()
    p = Progress(_plan(), stream=io.StringIO(), tty=False, clock=clock, prior_pace=4.0)
    assert p.time_left() == 400.0  # nothing done: the plan at the prior pace
    p.start_suite("p2p")
    clock.t += 10
    p.done("a")  # as estimated: the pace moves from 4 towards 1
    assert abs(p.pace() - (10 + 4 * PRIOR_S) / (10 + PRIOR_S)) < 1e-9


def test_the_tail_after_the_last_case_counts_until_finish() -> None:
    """tail_s (rdt-bench's shutdown and report) is part of the time left from the start; once every case is done
    it counts down as the running part, and finish() ends it with one last line saying 0s left, which the record
    keeps for estimate_at()."""
    from benchmarks._progress import estimate_at

    clock, out = Clock(), io.StringIO()
    p = Progress(_plan(), stream=out, tty=False, clock=clock, tail_s=20.0)
    assert p.time_left() == 120.0  # 100 of cases, 20 of tail
    p.start_suite("p2p")
    clock.t += 40
    p.done("a", "b")
    p.finish_suite()
    p.start_suite("objects")
    clock.t += 60
    p.done("c")
    p.finish_suite()  # pace 1: the 20 s of tail are what is left
    assert abs(p.time_left() - 20.0) < 1e-9
    assert LINE.match(_lines(out)[-1]).group(9) == "20s"
    clock.t += 5
    assert abs(p.time_left() - 15.0) < 1e-9  # counted down while it runs
    p.finish()
    assert p.time_left() == 0.0 and LINE.match(_lines(out)[-1]).group(9) == "0s"
    rec = p.record()
    assert rec["tail_s"] == 20.0 and estimate_at(rec, 105.0) == 0.0
    assert abs(estimate_at(rec, 102.0) - 18.0) < 1e-9
    p.finish()  # twice: no second line
    assert len([ln for ln in _lines(out) if ln.endswith("about 0s left")]) == 1
