"""Schedule exploration on a set of race bugs: how often ``--ddp-explore=20`` finds each, after how
many schedules; the same tests fixed, under many schedules (no false failure); and what a
schedule costs beyond the test's own time and the holds it injects.

The bugs are in ``races.py``: small multirank tests whose assertion is about a result, never the
timeline. Sessions: (1) every bug 20 times under normal timing (an autouse fixture with 20
params), to show each passes without exploration; (2) S sessions of ``--ddp-explore=20`` over
the bugs, each with its own random base seed; (3) the fixed suite 20 times under normal timing
and (4) once under ``--ddp-explore=100``, whose junit durations, less (N+1) plain runs and less
the holds the report lists, give the cost of a schedule; (5) the seed the first exploration
found for each bug, replayed R times with both cores kept busy by other processes.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator

from _common import Report, Session, Suite, median, ms, parser, progress, table, verdict
from races import RACES, source

TRIALS = """
import pytest


@pytest.fixture(autouse=True, params=range({n}))
def trial(request):
    return request.param
"""

_SCHEDULE = re.compile(r"failed under schedule (\d+) of (\d+)")
_SEED = re.compile(r"failed under schedule \d+ of \d+ \(seed (0x[0-9a-f]+)\)")
_HOLDS = re.compile(r"passed under all (\d+) schedules explored .*; holds ([0-9.]+) s in all")
_HEADER = re.compile(r"^_+ (test_\w+) _+$")


def _bug(case_name: str) -> str:
    name = case_name.split("::")[-1].split("[")[0]
    return name.removeprefix("test_")


def plain_passes(suite: Suite, folder: str, trials: int) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Per bug: how many of ``trials`` plain runs passed, and their call durations."""
    session = suite.run(folder, "-p", "no:randomly", duration_report="total")
    passed: dict[str, int] = defaultdict(int)
    seconds: dict[str, list[float]] = defaultdict(list)
    for case in session.cases:
        seconds[_bug(case.name)].append(case.seconds)
        if case.outcome == "passed":
            passed[_bug(case.name)] += 1
    missing = set(RACES) - set(seconds)
    if missing or len(session.cases) != trials * len(RACES):
        raise RuntimeError(f"plain session of {folder}: {len(session.cases)} cases\n{session.tail()}")
    return passed, seconds


PLAIN_FAILURE = 0  # what explored() gives a test whose plain run already failed


def explored(session: Session) -> dict[str, int | None]:
    """Per bug: the schedule that found it (1-based), PLAIN_FAILURE when its plain run failed
    (before any schedule), or None when it passed every schedule."""
    out: dict[str, int | None] = {}
    for case in session.cases:
        found = _SCHEDULE.search(case.message)
        if case.outcome == "passed":
            out[_bug(case.name)] = None
        else:
            out[_bug(case.name)] = int(found.group(1)) if found else PLAIN_FAILURE
    return out


def seeds_found(session: Session) -> dict[str, str]:
    """Per bug an exploration found: the seed its failure names."""
    out = {}
    for case in session.cases:
        seed = _SEED.search(case.message)
        if case.outcome != "passed" and seed:
            out[_bug(case.name)] = seed.group(1)
    return out


@contextlib.contextmanager
def cores_kept_busy(processes: int) -> Iterator[None]:
    """Other work on the machine: ``processes`` interpreters spinning until the block ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def replays_under_load(suite: Suite, seeds: dict[str, str], replays: int) -> dict[str, dict[str, int]]:
    """Per bug: how its seed's ``replays`` replays went, both cores kept busy: "again" (the
    schedule failed the test again), "plain" (its plain run failed first: the race showed by
    itself and the schedule never ran) or "passed"."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    with cores_kept_busy(2):
        for i in range(replays):
            progress(f"replay {i + 1}/{replays} of each found seed, both cores busy")
            for bug, seed in seeds.items():
                session = suite.run(f"test_races.py::test_{bug}", f"--ddp-schedule={seed}")
                message = session.cases[0].message if session.cases else ""
                if session.count("failed") != 1:
                    out[bug]["passed"] += 1
                elif f"failed under schedule {seed}" in message:
                    out[bug]["again"] += 1
                elif "failed in the plain run" in message:
                    out[bug]["plain"] += 1
                else:
                    raise RuntimeError(f"replay of {bug} under {seed}: {message}\n{session.tail()}")
    return out


def holds_by_test(session: Session) -> dict[str, tuple[int, float]]:
    """Per test of a -rA session: (schedules explored, seconds of holds in all)."""
    out, current = {}, ""
    for line in session.stdout.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
        found = _HOLDS.search(line)
        if found and current:
            out[current.removeprefix("test_")] = (int(found.group(1)), float(found.group(2)))
    return out


def replay_section(report: Report, seeds: dict[str, str], replayed: dict[str, dict[str, int]], replays: int) -> None:
    rows = []
    for bug, seed in seeds.items():
        went = replayed[bug]
        scheduled = went["again"] + went["passed"]
        rows.append(
            [bug, seed, f"{went['again']}/{scheduled}", went["plain"], "all", verdict(went["again"] == scheduled)]
        )
    report.section(
        f"The seed each bug was found with, replayed {replays} times on a loaded machine",
        table(
            [
                "bug",
                "seed",
                "replayed schedules that failed again",
                "replays whose plain run failed first",
                "target",
                "met",
            ],
            rows,
        ),
        [
            "Each replay is a pytest session of --ddp-schedule=SEED on the one test (a plain run, then the"
            " schedule), while two other processes spin on the machine's cores: the replays run slower"
            " than the exploration that found the seed, and than their own plain runs. A replay whose"
            " plain run failed (the race showed by itself under the load, and the schedule was not run)"
            " is counted apart.",
        ],
    )


def replays_only(args: argparse.Namespace) -> None:
    """One exploration session for the seeds, then their replays on a loaded machine."""
    replays = 2 if args.quick else 10
    report = Report("bench_explore_replays", "Schedule exploration: found seeds replayed on a loaded machine", args)
    with Suite({"test_races.py": source(bug=True)}, keep=args.keep) as suite:
        progress(f"one session of --ddp-explore=20 over {len(RACES)} bugs")
        seeds = seeds_found(suite.run("test_races.py", "--ddp-explore=20", duration_report="call"))
        replay_section(report, seeds, replays_under_load(suite, seeds, replays), replays)
    report.write()


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=20)
    p.add_argument("--replays-only", action="store_true", help="only (5): one exploration, its seeds replayed")
    args = p.parse_args()
    if args.replays_only:
        replays_only(args)
        return
    sessions = 3 if args.quick else args.repeats or 20
    trials = 5 if args.quick else 20
    fixed_schedules = 10 if args.quick else 100
    replays = 2 if args.quick else 10
    report = Report("bench_explore", "Schedule exploration: race bugs found, fixed code left alone, cost", args)
    files = {
        "plain/conftest.py": TRIALS.format(n=trials),
        "plain/test_races.py": source(bug=True),
        "plainfixed/conftest.py": TRIALS.format(n=trials),
        "plainfixed/test_fixed.py": source(bug=False),
        "test_races.py": source(bug=True),
        "test_fixed.py": source(bug=False),
    }
    with Suite(files, keep=args.keep) as suite:
        progress(f"plain runs: every bug {trials} times")
        passed, _ = plain_passes(suite, "plain", trials)
        found: dict[str, list[int | None]] = defaultdict(list)
        seeds: dict[str, str] = {}
        for s in range(sessions):
            progress(f"session {s + 1}/{sessions}: --ddp-explore=20 over {len(RACES)} bugs")
            session = suite.run("test_races.py", "--ddp-explore=20", duration_report="call")
            if len(session.cases) != len(RACES):
                raise RuntimeError(f"exploration session: {len(session.cases)} cases\n{session.tail()}")
            for bug, index in explored(session).items():
                found[bug].append(index)
            seeds = {**seeds_found(session), **seeds}  # the first session's seed of each bug
        progress(f"the fixed suite: {trials} plain runs, then --ddp-explore={fixed_schedules}")
        fixed_passed, fixed_plain = plain_passes(suite, "plainfixed", trials)
        fixed = suite.run("test_fixed.py", f"--ddp-explore={fixed_schedules}", "-rA", duration_report="total")
        replayed = replays_under_load(suite, seeds, replays)

    rows = []
    for bug, (depth, world, what) in RACES.items():
        explored_sessions = [i for i in found[bug] if i != PLAIN_FAILURE]
        hits = [i for i in explored_sessions if i is not None]
        share = len(hits) / max(len(explored_sessions), 1)
        target = 0.95 if depth == 1 else 0.80
        rows.append(
            [
                bug,
                what,
                world,
                depth,
                f"{passed[bug]}/{trials}",
                len(found[bug]) - len(explored_sessions),
                f"{share:.0%} ({len(hits)}/{len(explored_sessions)})",
                f"{statistics.median(hits):g}" if hits else "-",
                f">= {target:.0%}",
                verdict(share >= target and passed[bug] >= trials * 19 / 20),
            ]
        )
    report.section(
        f"Each bug: {trials} plain runs, then {sessions} sessions of --ddp-explore=20",
        table(
            [
                "bug",
                "what",
                "ranks",
                "depth",
                "plain runs passed",
                "sessions whose plain run failed",
                "explored sessions that found it",
                "median schedules to the first failure",
                "target",
                "met",
            ],
            rows,
        ),
        [
            "A session is one pytest run with its own random base seed: every test's 20 schedules differ"
            " from session to session. A session whose plain run of the test already failed (the race"
            " showed by itself: no schedule was run) is counted apart, not as found by exploration."
            " Depth is the number of orders that must all be inverted for the test to fail.",
        ],
    )

    by_test = holds_by_test(fixed)
    durations = {_bug(c.name): c.seconds for c in fixed.cases}
    cost_rows = []
    for bug in RACES:
        count, held = by_test.get(bug, (0, float("nan")))
        plain = median(fixed_plain[bug])
        extra = (durations.get(bug, float("nan")) - (count + 1) * plain - held) / max(count, 1)
        cost_rows.append(
            [
                bug,
                f"{fixed_passed[bug]}/{trials}",
                "passed" if bug in by_test else "FAILED",
                ms(plain),
                f"{held / max(count, 1) * 1000:.1f} ms",
                f"{extra * 1000:.1f} ms",
                verdict(bug in by_test and extra <= 0.005),
            ]
        )
    failures = fixed.count("failed") + fixed.count("error")
    report.section(
        f"The same tests fixed: {trials} plain runs, then --ddp-explore={fixed_schedules}",
        table(
            [
                "test (fixed)",
                "plain runs passed",
                f"{fixed_schedules} schedules",
                "plain run (setup+call+teardown, median)",
                "holds per schedule",
                "cost per schedule beyond the test's time and its holds",
                "<= 5 ms",
            ],
            cost_rows,
        )
        + "\n\n"
        + table(
            ["figure", "value", "target", "met"],
            [
                [
                    f"false failures over {fixed_schedules} schedules x {len(RACES)} tests",
                    failures,
                    "0",
                    verdict(failures == 0),
                ]
            ],
        ),
        [
            "Cost per schedule: (the test's duration with exploration - (schedules + 1) x the median plain"
            " duration - the holds) / schedules; durations are junit's setup+call+teardown, as a multirank"
            " test's ranks start in its setup and every schedule starts them again. The holds counted"
            " are, per segment, the longest hold of any rank, summed (the report's 'schedules'"
            " section): a held rank's peers wait for it at the next collective, so that is what a"
            " schedule adds to the run by design. A negative figure: the holds overlapped time the"
            " test spent waiting anyway.",
        ],
    )
    replay_section(report, seeds, replayed, replays)
    report.write()


if __name__ == "__main__":
    main()
