"""Cost of the leak guard per test: ``--ddp-leaks=off`` vs ``--ddp-leaks=fail`` on plain tests.

Sessions: one suite of trivial plain tests, run with the guard off and on (rounds interleaved).
The per-test cost is given three ways: the difference of the session walls divided by the
number of tests; the difference of the median junit durations of setup+call+teardown (the
guard snapshots before setup and compares after teardown; junit rounds to 1 ms); and the
difference of the median wall time of each test's whole run protocol, timed in the session
by a probe plugin (µs resolution, outermost hook wrapper, so it holds the guard's hooks).
In-process: ``LeakGuard().snapshot()`` and ``.find(snapshot)`` timed with timeit, in this
process with torch.distributed imported (as in every pytest process the plugin runs in).
"""

from __future__ import annotations

import json
import timeit
from collections import defaultdict

from _common import Report, Suite, interleaved, median, ms, parser, progress, repeats_of, sec, table, us, verdict

PLAIN_TEST = """
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    assert i >= 0
"""

# -p protocol_probe: each test's whole run protocol (setup, call, teardown, reports), timed.
PROTOCOL_PROBE = """
import json
import os
import time

import pytest

TIMES = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.perf_counter()
    try:
        return (yield)
    finally:
        TIMES.append(time.perf_counter() - started)


def pytest_sessionfinish(session):
    with open(os.environ["BENCH_PROBE_OUT"], "w") as f:
        json.dump(TIMES, f)
"""


def micro(number: int, rounds: int) -> list[list[object]]:
    """Median seconds per call of snapshot() and find() over timeit rounds."""
    import torch.distributed  # noqa: F401  (what _groups() looks at; imported in every pytest process)

    from pytest_ddphooks.leaks import LeakGuard

    guard = LeakGuard()
    before = guard.snapshot()
    assert guard.find(before) == [], "the benchmark process itself leaks"
    rows: list[list[object]] = []
    for label, stmt in (
        ("LeakGuard().snapshot()", guard.snapshot),
        ("LeakGuard().find(snapshot) (takes a second snapshot)", lambda: guard.find(before)),
    ):
        times = [t / number for t in timeit.repeat(stmt, number=number, repeat=rounds)]
        rows.append([label, f"{rounds} x {number}", us(median(times)), us(min(times))])
    return rows


def label(mode: str) -> str:
    return "-p no:ddphooks (reference)" if mode == "blocked" else f"--ddp-leaks={mode}"


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=5)
    args = p.parse_args()
    repeats = repeats_of(args)
    n = 100 if args.quick else 500
    report = Report("bench_leaks", "Leak guard: cost per test", args)
    modes = ["blocked", "off", "fail"]  # blocked: -p no:ddphooks, the plain-pytest reference
    walls: dict[str, list[float]] = defaultdict(list)
    per_test: dict[str, list[float]] = defaultdict(list)
    protocol: dict[str, list[float]] = defaultdict(list)
    files = {"test_plain.py": PLAIN_TEST.format(n=n), "protocol_probe.py": PROTOCOL_PROBE}
    with Suite(files, keep=args.keep) as suite:
        out = suite.dir / "protocol.json"
        env = {"BENCH_PROBE_OUT": str(out), "PYTHONPATH": str(suite.dir)}
        suite.run_ok("test_plain.py", expect=n)  # warm-up, not measured
        for r, mode in interleaved(repeats, modes):
            progress(f"round {r + 1}/{repeats}: {label(mode)}")
            opts = [] if mode == "blocked" else [f"--ddp-leaks={mode}"]
            s = suite.run_ok(
                "-p",
                "protocol_probe",
                *opts,
                "test_plain.py",
                expect=n,
                duration_report="total",
                env=env,
                plugin=mode != "blocked",
            )
            walls[mode].append(s.wall)
            per_test[mode].extend(s.durations())
            protocol[mode].extend(json.loads(out.read_text()))

    diff_wall = (median(walls["fail"]) - median(walls["off"])) / n
    diff_junit = median(per_test["fail"]) - median(per_test["off"])
    diff_protocol = median(protocol["fail"]) - median(protocol["off"])
    rows = [[label(m), repeats, sec(median(walls[m])), ms(median(per_test[m])), us(median(protocol[m]))] for m in modes]
    report.section(
        f"Sessions of {n} trivial plain tests",
        table(
            [
                "mode",
                "repeats",
                "session wall (median)",
                "per test setup+call+teardown (junit median)",
                "per test run protocol (probe median)",
            ],
            rows,
        )
        + "\n\n"
        + table(
            ["figure", "value", "target", "met"],
            [
                [
                    "guard cost per test: session wall difference / N",
                    ms(diff_wall),
                    "< 2 ms",
                    verdict(diff_wall < 2e-3),
                ],
                ["guard cost per test: junit median difference", ms(diff_junit), "< 2 ms", verdict(diff_junit < 2e-3)],
                [
                    "guard cost per test: probe median difference",
                    us(diff_protocol),
                    "< 2 ms",
                    verdict(diff_protocol < 2e-3),
                ],
            ],
        ),
        [
            "junit_duration_report=total: each testcase's time is setup+call+teardown, where the guard's"
            " snapshot (setup) and comparison (teardown) run. junit rounds to 1 ms, so the medians move in"
            " 1 ms steps. The session-wall difference carries the run-to-run noise of interpreter start-up"
            " and the torch import (about 0.1-0.3 s per session on a busy 2-core machine), divided by N."
            " The probe figure, per test inside the session, is the precise one.",
            "The -p no:ddphooks row is plain pytest (the plugin not loaded, so torch not imported either):"
            " a reference for what the plugin's other per-test hooks cost on a plain test.",
        ],
    )
    number, rounds = (200, 5) if args.quick else (1000, 7)
    progress("in-process timeit of snapshot() and find()")
    report.section(
        "In-process microbenchmark (no process group, no child process, torch.distributed imported)",
        table(["call", "rounds x calls", "median per call", "best per call"], micro(number, rounds)),
    )
    report.write()


if __name__ == "__main__":
    main()
