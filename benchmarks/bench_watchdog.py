"""The multirank watchdog: how fast a hang is reported, and what it costs on passing tests.

(a) Detection latency. Rank 0 waits in ``dist.barrier()`` that the other ranks never enter
(they sleep: were they to finish the test, the watchdog would stop rank 0 at once, as a
stall), under ``@pytest.mark.multirank(world_size=W, timeout=T)``. The latency is the test's call
duration (junit xml) minus T: the time from the time limit to the failure report (stacks
taken, ranks killed, diagnosis written). Each failure is checked to be the watchdog's
("hang after ...").

(b) Desync stop latency. Rank 0 calls ``all_reduce`` while the other ranks call ``broadcast``
under a 60 s limit: gloo never errors, so only the watchdog's desync look (every 0.5 s, two
looks in a row must agree) ends the test. The figure is the test's duration (setup, call and
teardown: the ranks are forked in the setup phase).

(c) Cost on the passing path. There is no switch to turn the watchdog off, and on a passing
test no stack is ever taken; the watchdog is the deadline of the wait loop in
``launch.run.RunWatch``, which blocks in ``Launcher.next_event`` (``select()`` on the fork
server's socket, woken once per rank note and exit). A conftest in the generated suite wraps
``RunWatch.start/wait_setup/wait_end``, ``Launcher.next_event`` and ``dump_stacks`` and
records the pytest process's CPU time (``time.process_time()``, i.e. RUSAGE_SELF user+sys)
in them, per test (setup and call phases), and over the whole session.

(d) Cost against the events recorded. A passing 2-rank test issues N all_reduce calls (each
recorded: two events per rank). The watchdog follows the ranks' event files every 0.5 s,
each look reading only what was written since the last; its pytest-process CPU in the run
must grow linearly with N (it grew quadratically before: 16.5 s for 20,000 collectives).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from _common import Report, Suite, interleaved, median, ms, parser, progress, repeats_of, table, us, verdict
from _suites import MULTIRANK_TEST

HANG_TEST = """
import time

import pytest
import torch.distributed as dist


@pytest.mark.parametrize("rep", range({k}))
@pytest.mark.multirank(world_size={sizes}, timeout={t})
def test_hang(rep, rank):
    if rank == 0:
        dist.barrier()  # the other ranks never enter it
    else:
        time.sleep(600)
"""

DESYNC_TEST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("rep", range({k}))
@pytest.mark.multirank(world_size={sizes}, timeout=60)
def test_desync(rep, rank):
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)
"""

MANY_TEST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("n", {counts})
@pytest.mark.multirank(world_size=2, timeout=600)
def test_many(n, rank):
    t = torch.ones(1)
    for _ in range(n):
        dist.all_reduce(t)
"""

PLAIN_TEST = """
import pytest
import torch


@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    assert torch.ones(1).item() == 1.0
"""

# Loaded only by the (b) sessions (-p cpu_probe); measures the pytest process's own CPU.
CPU_PROBE = """
import json
import os
import time

import pytest

from pytest_ddphooks.launch import launcher, run

TOTALS = {"run_job_cpu": 0.0, "run_job_calls": 0, "next_exit_cpu": 0.0, "next_exit_calls": 0,
          "collect_stacks_calls": 0}
TESTS = []
SESSION = {}


def _timed(fn, key):
    def wrapper(*args, **kwargs):
        started = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[key + "_cpu"] += time.process_time() - started
            TOTALS[key + "_calls"] += 1
    return wrapper


def _counted(fn, key):
    def wrapper(*args, **kwargs):
        TOTALS[key + "_calls"] += 1
        return fn(*args, **kwargs)
    return wrapper


for _name in ("start", "wait_setup", "wait_end"):
    setattr(run.RunWatch, _name, _timed(getattr(run.RunWatch, _name), "run_job"))
launcher.Launcher.next_event = _timed(launcher.Launcher.next_event, "next_exit")
run.dump_stacks = _counted(run.dump_stacks, "collect_stacks")


def pytest_sessionstart(session):
    SESSION["cpu0"] = time.process_time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = dict(TOTALS)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        return (yield)
    finally:
        row = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}
        row.update({k: TOTALS[k] - before[k] for k in TOTALS})
        TESTS.append(row)


def pytest_sessionfinish(session):
    out = {"session_cpu": time.process_time() - SESSION["cpu0"], "tests": TESTS, "totals": TOTALS}
    with open(os.environ["BENCH_CPU_OUT"], "w") as f:
        json.dump(out, f)
"""


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=3)
    p.add_argument("--limit", type=float, default=1.0, help="the hanging tests' timeout T in seconds (default 1)")
    args = p.parse_args()
    repeats = repeats_of(args)
    sizes = [2, 4, 8]
    hangs_per_size = 2  # per size, per round
    n = 10 if args.quick else 50
    counts = [1000, 5000, 20000] if args.quick else [5000, 20000, 100000]
    report = Report("bench_watchdog", "Watchdog: hang detection latency and passing-path cost", args)

    latency: dict[int, list[float]] = defaultdict(list)
    desync: dict[int, list[float]] = defaultdict(list)
    probes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    suite_files = {
        "test_hang.py": HANG_TEST.format(k=hangs_per_size, sizes=sizes, t=args.limit),
        "test_desync.py": DESYNC_TEST.format(k=hangs_per_size, sizes=sizes),
        "test_multirank.py": MULTIRANK_TEST.format(n=n),
        "test_plain.py": PLAIN_TEST.format(n=n),
        "cpu_probe.py": CPU_PROBE,
        "test_many.py": MANY_TEST.format(counts=counts),
    }
    with Suite(suite_files, keep=args.keep) as suite:
        out = suite.dir / "cpu.json"
        env = {"BENCH_CPU_OUT": str(out), "PYTHONPATH": str(suite.dir)}
        suite.run_ok("test_plain.py", expect=n)  # warm-up, not measured
        stuck = {"hang": ("hang after", latency, args.limit), "desync": ("desync: collective #1", desync, 0.0)}
        for r, name in interleaved(repeats, ["hang", "desync", "multirank", "plain"]):
            progress(f"round {r + 1}/{repeats}: {name}")
            if name in stuck:
                words, samples, offset = stuck[name]
                s = suite.run(f"test_{name}.py")
                expected = hangs_per_size * len(sizes)
                if s.count("failed") != expected:
                    raise RuntimeError(f"expected {expected} {name} tests to fail, got:\n{s.tail()}")
                for case in s.cases:
                    if not case.message.startswith(words):
                        raise RuntimeError(f"{case.name} failed, but not with {words!r}: {case.message}")
                    m = re.search(r"\[\d+-(\d+)\]", case.name)
                    assert m is not None, case.name
                    samples[int(m.group(1))].append(case.seconds - offset)
                continue
            suite.run_ok("-p", "cpu_probe", f"test_{name}.py", expect=n, env=env)
            probes[name].append(json.loads(out.read_text()))
        progress("events: one session of tests with many collectives")
        suite.run_ok("-p", "cpu_probe", "test_many.py", expect=len(counts), env=env)
        many = json.loads(out.read_text())["tests"]

    rows = []
    for size in sizes:
        d = latency[size]
        rows.append([size, len(d), ms(median(d)), ms(max(d)), verdict(max(d) < 2.0)])
    report.section(
        f"(a) Detection latency: test duration - T, T = {args.limit:g} s",
        table(["world size", "samples", "median", "max", "under 2 s (max)"], rows),
        [
            "Rank 0 blocks in dist.barrier(); ranks 1.. sleep (had they finished the test, rank 0 would be"
            " stopped at once, as waiting for ranks that left). The"
            " test duration (junit_duration_report=total) runs from the start of the setup phase, where"
            " the ranks are forked, to the end of the teardown, after the failure report; T counts from"
            " just before the ranks are forked, so the latency also holds the few milliseconds of"
            " preparing the job. Of it, up to 1 s is the stack collection"
            " (SIGUSR1 to each live rank, read once the dump files stop growing).",
        ],
    )

    rows = []
    for size in sizes:
        d = desync[size]
        rows.append([size, len(d), ms(median(d)), ms(max(d)), verdict(max(d) < 2.0)])
    report.section(
        "(b) Desync stop latency: duration of a test whose ranks sit in mismatched collectives, limit 60 s",
        table(["world size", "samples", "median", "max", "under 2 s (max)"], rows),
        [
            "Rank 0 in all_reduce #1, the others in broadcast #1: gloo waits forever. The watchdog looks at"
            " the recorded events every 0.5 s and stops the ranks when two looks in a row find the same"
            " mismatched collective with every rank that entered it still inside; the duration also"
            " holds the ranks' start and the stack collection.",
        ],
    )

    def per_test(name: str, key: str) -> list[float]:
        return [float(t[key]) for probe in probes[name] for t in probe["tests"]]

    def per_session(name: str) -> float:
        return median(probe["session_cpu"] / n for probe in probes[name])

    mr, pl = "multirank", "plain"
    calls_per_test = median(per_test(mr, "next_exit_calls"))
    stacks = sum(int(probe["totals"]["collect_stacks_calls"]) for probe in probes[mr])
    watchdog = median(per_test(mr, "next_exit_cpu"))
    rows = [
        [
            "pytest-process CPU per test, whole protocol (median)",
            us(median(per_test(mr, "cpu"))),
            us(median(per_test(pl, "cpu"))),
        ],
        ["wall per test, whole protocol (median)", ms(median(per_test(mr, "wall"))), ms(median(per_test(pl, "wall")))],
        ["  of the CPU: in RunWatch (spawn, wait, collect)", us(median(per_test(mr, "run_job_cpu"))), "-"],
        ["  of which in Launcher.next_event (the watchdog's wait loop)", us(watchdog), "-"],
        ["Launcher.next_event calls per test (median)", f"{calls_per_test:g}", "-"],
        ["dump_stacks calls (all passing tests)", str(stacks), "-"],
        ["session CPU (start to finish) / N", us(per_session(mr)), us(per_session(pl))],
    ]
    report.section(
        f"(c) Orchestrating (pytest) process CPU on passing tests, {n} tests per session",
        table(["figure", "multirank, 2 ranks", "plain test"], rows)
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [["watchdog part (next_event CPU) per passing test under 1 ms", us(watchdog), verdict(watchdog < 1e-3)]],
        ),
        [
            "CPU is time.process_time() of the pytest process only (the ranks and the launcher are other"
            " processes). The plain column is the same session shape without multirank, for reference.",
            "The watchdog has no thread: RunWatch blocks in select() until a rank notes a phase or"
            " exits, the deadline passes or, for a test still running after 0.5 s, the next look at"
            " the events is due, so on a short passing test its cost is the wake-ups (a note and an"
            " exit per rank) and unpickling those messages. Everything else in RunWatch is"
            " orchestration: sending the job, reading results, output and recorded events, building"
            " the timeline.",
        ],
    )
    rows = []
    for count, row in zip(counts, many, strict=True):
        per_k = row["run_job_cpu"] / (count / 1000)
        rows.append([f"{count:,}", f"{row['wall']:.1f} s", f"{row['run_job_cpu']:.2f} s", ms(per_k)])
    per_k = [row["run_job_cpu"] / (c / 1000) for c, row in zip(counts, many, strict=True)]
    linear = max(per_k) <= 2 * min(per_k)
    report.section(
        "(d) The watchdog against the events recorded: a passing 2-rank test with N all_reduce calls",
        table(["N collectives", "test wall", "pytest-process CPU in RunWatch", "per 1,000 collectives"], rows)
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [
                [
                    "CPU grows linearly with N (per-1,000 cost within 2x across N)",
                    f"{min(per_k) * 1000:.1f}-{max(per_k) * 1000:.1f} ms",
                    verdict(linear),
                ]
            ],
        ),
        [
            "Each recorded all_reduce writes two events per rank. The watchdog reads each event file"
            " from where it stopped the last time (every 0.5 s), and at the run's end what was written"
            " since: every record is read once, and the timeline is built from what was read; both"
            " grow linearly with N.",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
