"""The tools people already use: what coverage of rank code costs per test against coverage of
the same code in a plain test, and how long ``--ddp-report`` takes to write the page of 500
multirank tests.

Coverage: four sessions per round, interleaved: N 2-rank multirank tests that call a function
of a small package, with and without ``--cov``, and N plain tests calling the same function,
with and without. Each session measures its own test loop from inside (a ``conftest.py`` of
the generated suite, reading only clocks and ``/proc``): from the first test's start to the last
test's end, the CPU of the pytest process and of every process under it (the fork server, and
the ranks it reaped, read once more as the session finishes, when every rank was reaped), and the
wall; divided by N.
Starting the interpreter, importing torch, coverage's start and report are outside the loop,
so they neither count nor add their noise (in sessions of a few seconds they used to swamp a
plain test's 1 ms). What ``--cov`` adds is taken round by round (the two sessions of a kind run
one after the other) and reported as the median over the rounds with the middle half of them.

Report: ``htmlreport.write_report`` timed in this process on 500 views of synthetic timelines
(2 ranks x 60 events, and 8 ranks x 200 events), best of 3.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    ROOT,
    Report,
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

# The session's own view of its test loop: CPU of this process and of every process under it
# (a process's own time, and the time of the children it reaped), and the wall.
LOOP_PROBE = """
import json
import os
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_first = None
_last = None
_items = 0


def _under_us():
    total = 0.0
    me = os.getpid()
    for tid in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                kids = f.read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK
    return total


def _clocks():
    return {"wall": time.monotonic(), "own": time.process_time()}


def pytest_runtest_logstart(nodeid, location):
    global _first
    if _first is None:
        _first = {**_clocks(), "under": _under_us()}


def pytest_runtest_logfinish(nodeid, location):
    global _last, _items
    _items += 1
    _last = _clocks()  # only clocks here: reading /proc would add work inside the loop measured


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session):
    # the ranks of the last tests were reaped as the test loop ended; the fork server still runs
    if _last is not None:
        _last["under"] = _under_us()
    yield


def pytest_unconfigure(config):
    out = os.environ.get("BENCH_LOOP_OUT")
    if out and _first is not None and _last is not None:
        with open(out, "w") as f:
            json.dump({"items": _items, **{k: _last[k] - _first[k] for k in _first}}, f)
"""

VARIANTS = ("multirank", "multirank --cov", "plain", "plain --cov")


def coverage_cost(n: int, repeats: int, keep: bool) -> dict[str, list[dict[str, float]]]:
    """Every variant's test loop, per round: per test wall, CPU of the pytest process, CPU of
    the processes under it (seconds)."""
    files = {
        "mypkg/__init__.py": PACKAGE,
        "conftest.py": LOOP_PROBE,
        "test_multirank.py": MULTIRANK.format(n=n),
        "test_plain.py": PLAIN.format(n=n),
    }
    loops: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with Suite(files, keep=keep) as suite:
        out = str(suite.dir / "loop.json")
        env = {"PYTHONPATH": str(suite.dir), "BENCH_LOOP_OUT": out}
        suite.run_ok("test_multirank.py", "--cov=mypkg", expect=n, env=env)  # warm-up
        for r, variant in interleaved(repeats, VARIANTS):
            progress(f"round {r + 1}/{repeats}: {variant}, {n} tests")
            kind, *cov = variant.split()
            args = [f"test_{kind}.py", *(["--cov=mypkg", "--cov-report="] if cov else [])]
            suite.run_ok(*args, expect=n, env=env)
            with open(out, encoding="utf-8") as f:
                loop = json.load(f)
            items = loop["items"]
            loops[variant].append(
                {
                    "wall": loop["wall"] / items,
                    "pytest": loop["own"] / items,
                    "under": loop["under"] / items,
                    "cpu": (loop["own"] + loop["under"]) / items,
                }
            )
    return loops


def _added_by_round(loops: dict[str, list[dict[str, float]]], kind: str, of: str) -> list[float]:
    """What ``--cov`` adds to a test of ``kind``, round by round."""
    return [cov[of] - plain[of] for cov, plain in zip(loops[f"{kind} --cov"], loops[kind], strict=True)]


def _spread(values: list[float]) -> str:
    """The middle half of the rounds, in ms."""
    ordered = sorted(values)
    low, high = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
    return f"{low * 1e3:+.1f} .. {high * 1e3:+.1f} ms"


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
    p = parser(__doc__.splitlines()[0], repeats=9)
    args = p.parse_args()
    repeats = repeats_of(args)
    n = 50 if args.quick else 200
    report = Report("bench_tools", "Coverage of rank code, and the HTML report", args)

    loops = coverage_cost(n, repeats, args.keep)
    of_all = ("wall", "pytest", "under", "cpu")
    rows = [[v, repeats, *(ms(median([loop[of] for loop in loops[v]])) for of in of_all)] for v in VARIANTS]
    by_round = {(kind, of): _added_by_round(loops, kind, of) for kind in ("multirank", "plain") for of in of_all}
    labels = {
        "wall": "wall",
        "cpu": "CPU of every process",
        "pytest": "CPU of the pytest process (information)",
        "under": "CPU of the processes under it: fork server and ranks (information)",
    }
    figures = []
    for of in ("wall", "cpu", "pytest", "under"):
        mr, pl = median(by_round[("multirank", of)]), median(by_round[("plain", of)])
        judged = of in ("wall", "cpu")
        figures.append(
            [
                f"--cov added per test: {labels[of]}",
                ms(mr),
                _spread(by_round[("multirank", of)]),
                ms(pl),
                _spread(by_round[("plain", of)]),
                verdict(mr <= max(pl, 0.0) + 1e-3) if judged else "",
            ]
        )
    report.section(
        f"Coverage: sessions of {n} tests calling the same function, with and without --cov",
        table(
            ["session", "repeats", "per test: wall", "pytest CPU", "CPU under it", "all CPU"],
            rows,
        )
        + "\n\n"
        + table(
            [
                "figure",
                "multirank test (2 ranks)",
                "middle half of rounds",
                "plain test",
                "middle half of rounds",
                "no more than plain",
            ],
            figures,
        ),
        [
            "Per test: the session's test loop, from the first test's start to the last test's end,"
            " measured by the session itself (a conftest.py reading clocks and /proc), over the N"
            " tests; the first table gives the median of each session over the rounds. CPU under"
            " the pytest process: the fork server's own and that of the ranks it reaped. What --cov"
            " adds is taken round by round from the two sessions of a kind run one after the other;"
            " the figure is the median over the rounds. 'No more than plain' allows 1 ms.",
            "Each rank measures only the test's own code (fixtures, body, finalizers): the fork server"
            " started the measurement once, paused, and decided for every loaded module whether it is"
            " measured; a rank resumes it around the test's code and hands its lines over with its"
            " result; the pytest process adds them to its own measurements. The harness's work in the"
            " pytest process is not measured.",
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
