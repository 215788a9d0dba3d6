"""The tools people already use: what coverage of rank code costs per test against coverage of
the same code in a plain test, and how long ``--ddp-report`` takes to write the page of 500
multirank tests.

Coverage: eight sessions per round, interleaved: N and 3N 2-rank multirank tests that call a
function of a small package, with and without ``--cov``, and N and 3N plain tests calling the
same function, with and without. Per test, the difference ``--cov`` makes in each kind: the
session wall and the CPU of the whole process tree at 3N less at N, over the 2N tests between
(what a session pays once cancels), and the median junit duration for information.

Report: ``htmlreport.write_report`` timed in this process on 500 views of synthetic timelines
(2 ranks x 60 events, and 8 ranks x 200 events), best of 3.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _common import (
    ROOT,
    Report,
    Session,
    Suite,
    interleaved,
    median,
    ms,
    parser,
    progress,
    repeats_of,
    sec,
    table,
    verdict,
)

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


def coverage_cost(n: int, repeats: int, keep: bool) -> dict[tuple[str, int], list[Session]]:
    """Every variant at N and 3N tests, interleaved: the sessions of each (variant, size)."""
    sizes = (n, 3 * n)
    files = {"mypkg/__init__.py": PACKAGE}
    for size in sizes:
        files[f"test_multirank_{size}.py"] = MULTIRANK.format(n=size)
        files[f"test_plain_{size}.py"] = PLAIN.format(n=size)
    sessions: dict[tuple[str, int], list[Session]] = defaultdict(list)
    runs = [(variant, size) for variant in VARIANTS for size in sizes]
    with Suite(files, keep=keep) as suite:
        env = {"PYTHONPATH": str(suite.dir)}
        suite.run_ok(f"test_multirank_{n}.py", "--cov=mypkg", expect=n, env=env)  # warm-up
        for r, (variant, size) in interleaved(repeats, runs):
            progress(f"round {r + 1}/{repeats}: {variant}, {size} tests")
            kind, *cov = variant.split()
            args = [f"test_{kind}_{size}.py", *(["--cov=mypkg", "--cov-report="] if cov else [])]
            sessions[(variant, size)].append(suite.run_ok(*args, expect=size, env=env))
    return sessions


def _marginal(sessions: dict[tuple[str, int], list[Session]], variant: str, n: int, of: str) -> float:
    """What one more test costs a session of ``variant`` (``of``: "wall" or "cpu"): the median
    session at 3N less the one at N, over the 2N tests between (fixed costs cancel)."""
    big = median([getattr(s, of) for s in sessions[(variant, 3 * n)]])
    small = median([getattr(s, of) for s in sessions[(variant, n)]])
    return (big - small) / (2 * n)


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

    sessions = coverage_cost(n, repeats, args.keep)
    rows = []
    for v in VARIANTS:
        per_test = {of: _marginal(sessions, v, n, of) for of in ("wall", "cpu")}
        durations = [d for s in sessions[(v, n)] + sessions[(v, 3 * n)] for d in s.durations()]
        rows.append([v, repeats, ms(per_test["wall"]), ms(per_test["cpu"]), ms(median(durations))])
    added = {
        (kind, of): _marginal(sessions, f"{kind} --cov", n, of) - _marginal(sessions, kind, n, of)
        for kind in ("multirank", "plain")
        for of in ("wall", "cpu")
    }
    junit = {
        kind: median([d for s in sessions[(f"{kind} --cov", n)] for d in s.durations()])
        - median([d for s in sessions[(kind, n)] for d in s.durations()])
        for kind in ("multirank", "plain")
    }
    figures = []
    for label, of in (("session wall", "wall"), ("CPU of every process (pytest, fork server, ranks)", "cpu")):
        mr, pl = added[("multirank", of)], added[("plain", of)]
        figures.append([f"--cov added per test: {label}", ms(mr), ms(pl), verdict(mr <= max(pl, 0.0) + 1e-3)])
    figures.append(["--cov added per test: junit median (information)", ms(junit["multirank"]), ms(junit["plain"]), ""])
    report.section(
        f"Coverage: sessions of {n} and {3 * n} tests calling the same function, with and without --cov",
        table(["session", "repeats", "per test: wall", "per test: CPU", "junit median"], rows)
        + "\n\n"
        + table(["figure", "multirank test (2 ranks)", "plain test", "no more than plain"], figures),
        [
            "Per test: the median session of 3N tests less the median session of N, over the 2N tests"
            " between, so what a session pays once (starting coverage, the report, the fork server)"
            " cancels. CPU is user + system time of the whole process tree. 'No more than plain'"
            " allows 1 ms. The junit median (setup + call + teardown of a test, rounded to 1 ms) is"
            " shown for information: a multirank test's own wall also holds its ranks' work, which"
            " runs alongside the pytest process on 2 cores.",
            "Each rank measures only the test's own code (fixtures, body, finalizers; the fork server"
            " prepared the measurement once and decided for every loaded module whether it is"
            " measured) and hands its lines over with its result; the pytest process adds them to its"
            " own measurements. The harness's work in the pytest process is not measured.",
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
