"""The multirank watchdog: how fast a hang is reported, and what it costs on passing tests.

(a) Detection latency. Rank 0 waits in ``dist.barrier()`` that the other ranks never enter,
under ``@pytest.mark.multirank(world_size=W, timeout=T)``. The latency is the test's call
duration (junit xml) minus T: the time from the time limit to the failure report (stacks
taken, ranks killed, diagnosis written). Each failure is checked to be the watchdog's
("hang after ...").

(b) Desync stop latency. Rank 0 calls ``all_reduce`` while the other ranks call ``broadcast``
under a 60 s limit: gloo never errors, so only the watchdog's desync look (every 0.5 s, two
looks in a row must agree) ends the test. The figure is the test's call duration.

(c) Cost on the passing path. There is no switch to turn the watchdog off, and on a passing
test the hang code (``pytest_ddphooks.hangs``) is never called; the watchdog is the deadline
of the wait loop in ``launch.run.run_job``, which blocks in ``Launcher.next_exit``
(``select()`` on the launcher's socket, woken once per rank exit). A conftest in the
generated suite wraps ``run_job``, ``Launcher.next_exit`` and ``hangs.collect_stacks`` and
records the pytest process's CPU time (``time.process_time()``, i.e. RUSAGE_SELF user+sys)
in them, per test, and over the whole session (session start to finish).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from _common import Report, Suite, interleaved, median, ms, parser, progress, repeats_of, table, us, verdict
from _suites import MULTIRANK_TEST

HANG_TEST = """
import pytest
import torch.distributed as dist


@pytest.mark.parametrize("rep", range({k}))
@pytest.mark.multirank(world_size={sizes}, timeout={t})
def test_hang(rep, rank):
    if rank == 0:
        dist.barrier()  # the other ranks never enter it
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

import pytest_ddphooks.plugin as ddp_plugin
from pytest_ddphooks import hangs
from pytest_ddphooks.launch import zygote

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


ddp_plugin.run_job = _timed(ddp_plugin.run_job, "run_job")
zygote.Launcher.next_exit = _timed(zygote.Launcher.next_exit, "next_exit")
hangs.collect_stacks = _counted(hangs.collect_stacks, "collect_stacks")


def pytest_sessionstart(session):
    SESSION["cpu0"] = time.process_time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
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

    rows = []
    for size in sizes:
        d = latency[size]
        rows.append([size, len(d), ms(median(d)), ms(max(d)), verdict(max(d) < 2.0)])
    report.section(
        f"(a) Detection latency: call duration - T, T = {args.limit:g} s",
        table(["world size", "samples", "median", "max", "under 2 s (max)"], rows),
        [
            "Rank 0 blocks in dist.barrier(); ranks 1.. finish the body and wait in the exit barrier. The"
            " call duration (junit_duration_report=call) runs from the start of the call phase to the"
            " failure report; T counts from just before the ranks are forked, so the latency also holds"
            " the few milliseconds of preparing the job. Of it, up to 1 s is the stack collection"
            " (SIGUSR1 to each live rank, read once the dump files stop growing).",
        ],
    )

    rows = []
    for size in sizes:
        d = desync[size]
        rows.append([size, len(d), ms(median(d)), ms(max(d)), verdict(max(d) < 2.0)])
    report.section(
        "(b) Desync stop latency: call duration of a test whose ranks sit in mismatched collectives, limit 60 s",
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
            "call phase: pytest-process CPU per test (median)",
            us(median(per_test(mr, "cpu"))),
            us(median(per_test(pl, "cpu"))),
        ],
        ["call phase: wall per test (median)", ms(median(per_test(mr, "wall"))), ms(median(per_test(pl, "wall")))],
        ["  of the CPU: in run_job (spawn, wait, collect)", us(median(per_test(mr, "run_job_cpu"))), "-"],
        ["  of which in Launcher.next_exit (the watchdog's wait loop)", us(watchdog), "-"],
        ["Launcher.next_exit calls per test (median)", f"{calls_per_test:g}", "-"],
        ["hangs.collect_stacks calls (all passing tests)", str(stacks), "-"],
        ["session CPU (start to finish) / N", us(per_session(mr)), us(per_session(pl))],
    ]
    report.section(
        f"(c) Orchestrating (pytest) process CPU on passing tests, {n} tests per session",
        table(["figure", "multirank, 2 ranks", "plain test"], rows)
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [["watchdog part (next_exit CPU) per passing test under 1 ms", us(watchdog), verdict(watchdog < 1e-3)]],
        ),
        [
            "CPU is time.process_time() of the pytest process only (the ranks and the launcher are other"
            " processes). The plain column is the same session shape without multirank, for reference.",
            "The watchdog has no thread: run_job blocks in select() until a rank exits, the deadline"
            " passes or, for a test still running after 0.5 s, the next desync look is due, so on a"
            " short passing test its cost is the wake-ups (one per rank exit) and unpickling the exit"
            " messages. Everything else in run_job is orchestration: sending"
            " the job, reading results, output and recorded events, building the timeline.",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
