"""The tools people already use: what coverage of rank code costs per test against coverage of
the same code in a plain test, and how long ``--ddp-report`` takes to write the page of 500
multirank tests.

Coverage: four sessions per round, interleaved: N 2-rank multirank tests that call a function
of a small package, with and without ``--cov``, and N plain tests calling the same function,
with and without. Each session measures its own test loop from inside (a ``conftest.py`` of
the generated suite, reading only clocks and ``/proc``): from the second test's start to the
last test's end (the first test starts the fork server, whose one-time start-up is the
session's), the CPU of the pytest process, of the fork server, and of the ranks, and the wall;
divided by N - 1. The ranks' CPU is taken in each rank as it leaves, and counted by its median (a
rank's CPU varies by +-0.5 ms from session to session on this machine, which swamps a
difference of 1 ms in the sum of the reaped ranks; that sum is given too).
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

WORLD_SIZE = 2

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
@pytest.mark.multirank(world_size={world_size})
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
import resource
import time

import pytest

# Each rank's CPU up to its exit (user + system, all its threads), one line per rank: a median
# over hundreds of ranks is steady where the sum of the reaped ranks' CPU carries the noise of
# every slow one. A benchmark's probe into the harness: the rank's own last call is wrapped.
_RANKS_OUT = os.environ.get("BENCH_RANKS_OUT")
if _RANKS_OUT:
    import pytest_ddphooks.launch.rank as _rank

    _leave = _rank._leave

    def _leave_counted(code):
        used = resource.getrusage(resource.RUSAGE_SELF)
        fd = os.open(_RANKS_OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{used.ru_utime + used.ru_stime}\\n".encode())
        os.close(fd)
        _leave(code)

    _rank._leave = _leave_counted

_TICK = os.sysconf("SC_CLK_TCK")
_first = None
_last = None
_items = 0
_seen = False


def _under_us():
    own = reaped = 0.0
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
            own += (int(fields[11]) + int(fields[12])) / _TICK
            reaped += (int(fields[13]) + int(fields[14])) / _TICK
    return own, reaped


def _clocks():
    return {"wall": time.monotonic(), "own": time.process_time()}


def pytest_runtest_logstart(nodeid, location):
    global _first
    # from the second test on: the first one starts the fork server, whose one-time start-up
    # (huge pages for its memory: 0.1-0.3 s of CPU) is the session's, not a test's
    if _first is None and _seen:
        own, reaped = _under_us()
        _first = {**_clocks(), "server": own, "reaped": reaped}


def pytest_runtest_logfinish(nodeid, location):
    global _last, _items, _seen
    _seen = True
    if _first is None:
        return
    _items += 1
    _last = _clocks()  # only clocks here: reading /proc would add work inside the loop measured


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session):
    # the ranks of the last tests were reaped as the test loop ended; the fork server still runs
    if _last is not None:
        _last["server"], _last["reaped"] = _under_us()
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
        "test_multirank.py": MULTIRANK.format(n=n, world_size=WORLD_SIZE),
        "test_plain.py": PLAIN.format(n=n),
    }
    loops: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with Suite(files, keep=keep) as suite:
        out = str(suite.dir / "loop.json")
        ranks_out = suite.dir / "ranks.txt"
        env = {"PYTHONPATH": str(suite.dir), "BENCH_LOOP_OUT": out, "BENCH_RANKS_OUT": str(ranks_out)}
        suite.run_ok("test_multirank.py", "--cov=mypkg", expect=n, env=env)  # warm-up
        for r, variant in interleaved(repeats, VARIANTS):
            progress(f"round {r + 1}/{repeats}: {variant}, {n} tests")
            kind, *cov = variant.split()
            args = [f"test_{kind}.py", *(["--cov=mypkg", "--cov-report="] if cov else [])]
            ranks_out.unlink(missing_ok=True)
            suite.run_ok(*args, expect=n, env=env)
            with open(out, encoding="utf-8") as f:
                loop = json.load(f)
            items = loop["items"]
            rank_cpu = [float(x) for x in ranks_out.read_text().split()] if ranks_out.exists() else []
            # a rank's median, times the ranks of a test (a set of ranks prepared for a test that
            # never came, at the session's end, is among them: the median is not moved by it)
            ranks = median(rank_cpu) * WORLD_SIZE if rank_cpu else 0.0
            loops[variant].append(
                {
                    "wall": loop["wall"] / items,
                    "pytest": loop["own"] / items,
                    "server": loop["server"] / items,
                    "ranks": ranks,
                    "reaped": loop["reaped"] / items,
                    "cpu": (loop["own"] + loop["server"]) / items + ranks,
                    "sums": (loop["own"] + loop["server"] + loop["reaped"]) / items,
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
    of_all = ("wall", "pytest", "server", "ranks", "cpu", "sums")
    rows = [[v, repeats, *(ms(median([loop[of] for loop in loops[v]])) for of in of_all)] for v in VARIANTS]
    by_round = {(kind, of): _added_by_round(loops, kind, of) for kind in ("multirank", "plain") for of in of_all}
    labels = {
        "wall": "wall",
        "cpu": "CPU of every process (pytest, fork server, ranks by their median)",
        "pytest": "CPU of the pytest process (information)",
        "server": "CPU of the fork server (information)",
        "ranks": "CPU of the ranks, by their median (information)",
        "sums": "CPU of every process, the reaped ranks' sum instead of their median (information)",
    }
    figures = []
    for of in ("wall", "cpu", "pytest", "server", "ranks", "sums"):
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
            [
                "session",
                "repeats",
                "per test: wall",
                "pytest CPU",
                "fork server CPU",
                "ranks CPU (median x2)",
                "all CPU",
                "all CPU (ranks summed)",
            ],
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
            "Per test: the session's test loop, from the second test's start to the last test's end"
            " (the first test starts the fork server: its one-time start-up, moving its memory into"
            " huge pages, costs 0.1-0.3 s of CPU, more under --cov, and was counted as 1-1.6 ms a"
            " test of the fork server's before), measured by the session itself (a conftest.py"
            " reading clocks and /proc), over those N - 1 tests; the first table gives the median"
            " of each session over the rounds. The fork"
            " server's CPU is its own; the ranks' is each rank's CPU up to its exit (read in the"
            " rank: the generated conftest.py wraps its last call), their median over the session"
            " times the 2 ranks of a test: the sum of the reaped ranks' CPU, also given, carries"
            " the noise of every slow rank of this machine (+-0.5 ms a rank from session to"
            " session), which swamps a difference of 1 ms. What --cov"
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
