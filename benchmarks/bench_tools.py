"""The tools people already use: what coverage of rank code costs per test against coverage of
the same code in a plain test, and how long ``--ddp-report`` takes to write the page of 500
multirank tests.

Coverage: four sessions per round, interleaved: N 2-rank multirank tests that call a function
of a small package, with and without ``--cov``, and N plain tests calling the same function,
with and without. Per test, the difference ``--cov`` makes in each kind: from the session walls
(divided by N) and from the median junit duration (setup+call+teardown: a multirank test's ranks
start in its setup). Report: ``htmlreport.write_report`` timed in this process on 500 views of
synthetic timelines (2 ranks x 60 events, and 8 ranks x 200 events), best of 3.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _common import ROOT, Report, Suite, interleaved, median, ms, parser, progress, repeats_of, sec, table, verdict

sys.path.insert(0, str(ROOT / "tests"))

PACKAGE = """
def on_rank(rank, world_size):
    if rank == 0:
        total = sum(range(100))
    else:
        total = -sum(range(100))
    for _ in range(world_size):
        total += 1
    return total
"""

MULTIRANK = """
import pytest
import mypkg


@pytest.mark.parametrize("i", range({n}))
@pytest.mark.multirank(world_size=2)
def test_ranks(i, rank, world_size):
    assert mypkg.on_rank(rank, world_size) is not None
"""

PLAIN = """
import pytest
import mypkg


@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    assert mypkg.on_rank(0, 2) is not None
    assert mypkg.on_rank(1, 2) is not None
"""

VARIANTS = ("multirank", "multirank --cov", "plain", "plain --cov")


def coverage_cost(n: int, repeats: int, keep: bool) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    files = {
        "mypkg/__init__.py": PACKAGE,
        "test_multirank.py": MULTIRANK.format(n=n),
        "test_plain.py": PLAIN.format(n=n),
    }
    walls: dict[str, list[float]] = defaultdict(list)
    durations: dict[str, list[float]] = defaultdict(list)
    with Suite(files, keep=keep) as suite:
        env = {"PYTHONPATH": str(suite.dir)}
        suite.run_ok("test_multirank.py", "--cov=mypkg", expect=n, env=env)  # warm-up
        for r, variant in interleaved(repeats, VARIANTS):
            progress(f"round {r + 1}/{repeats}: {variant}")
            kind, *cov = variant.split()
            args = [f"test_{kind}.py", *(["--cov=mypkg", "--cov-report="] if cov else [])]
            session = suite.run_ok(*args, expect=n, env=env)
            walls[variant].append(session.wall)
            durations[variant].extend(session.durations())
    return walls, durations


def _views(tests: int, world: int, per_rank: int) -> list[dict]:
    from synth import Sim

    from pytest_ddphooks.htmlreport import multirank_view

    views = []
    for t in range(tests):
        sim = Sim(world)
        for step in range(per_rank // 6):
            for r in range(world):
                sim.call(r, f"hook{step % 5}")
            sim.coll("all_reduce")
        timeline = sim.timeline()
        view = multirank_view(f"test_report.py::test_{t}", timeline, world_size=world)
        view.update(outcome="passed", duration=0.05)
        views.append(view)
    return views


def report_seconds(tests: int, world: int, per_rank: int) -> tuple[float, int, int]:
    """Best of 3 seconds to write the page; its size in bytes; spans per test."""
    from pytest_ddphooks.htmlreport import write_report

    views = _views(tests, world, per_rank)
    events = len(views[0]["timeline"]["spans"])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "report.html")
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            write_report(path, views, f"{tests} tests")
            best = min(best, time.perf_counter() - started)
        size = Path(path).stat().st_size
    return best, size, events


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=5)
    args = p.parse_args()
    repeats = repeats_of(args)
    n = 20 if args.quick else 100
    report = Report("bench_tools", "Coverage of rank code, and the HTML report", args)

    walls, durations = coverage_cost(n, repeats, args.keep)
    rows = [[v, repeats, sec(median(walls[v])), ms(median(durations[v]))] for v in VARIANTS]
    added = {
        kind: (
            (median(walls[f"{kind} --cov"]) - median(walls[kind])) / n,
            median(durations[f"{kind} --cov"]) - median(durations[kind]),
        )
        for kind in ("multirank", "plain")
    }
    report.section(
        f"Coverage: sessions of {n} tests calling the same function, with and without --cov",
        table(["session", "repeats", "wall (median)", "per test (junit median)"], rows)
        + "\n\n"
        + table(
            ["figure", "multirank test (2 ranks)", "plain test", "no more than plain"],
            [
                [
                    "--cov added per test, from the session walls / N",
                    ms(added["multirank"][0]),
                    ms(added["plain"][0]),
                    verdict(added["multirank"][0] <= max(added["plain"][0], 0.0) + 1e-3),
                ],
                [
                    "--cov added per test, junit median",
                    ms(added["multirank"][1]),
                    ms(added["plain"][1]),
                    verdict(added["multirank"][1] <= max(added["plain"][1], 0.0) + 1e-3),
                ],
            ],
        ),
        [
            "Each rank measures only the test (the fork server prepared the measurement once and"
            " decided for every loaded module whether it is measured, so a rank's start costs about"
            " 0.5 ms) and hands its lines over with its result; the pytest process adds them to its"
            " own measurements. The harness's work in the pytest process is not measured. junit"
            " rounds to 1 ms. 'No more than plain' allows 1 ms.",
        ],
    )

    rows = []
    for world, per_rank in ((2, 60), (8, 200)):
        tests = 500
        progress(f"report: {tests} tests x {world} ranks x {per_rank} events")
        seconds, size, spans = report_seconds(tests, world, per_rank)
        rows.append([tests, world, per_rank, spans, sec(seconds), f"{size / 2**20:.1f} MiB", verdict(seconds <= 2.0)])
    report.section(
        "--ddp-report: writing the page (best of 3, in-process)",
        table(["tests", "ranks", "events per rank", "spans per test", "write time", "page size", "<= 2 s"], rows),
        ["The page is one self-contained file: the data as JSON inside it, drawn by its own script."],
    )
    report.write()


if __name__ == "__main__":
    main()
