"""Multirank tests under pytest-xdist: a rendezvous stress test, and the suite speed-up.

(a) Stress: many 2-rank tests (one all_reduce each) under ``-n 2``: two pytest workers, each
with its own warm launcher, fork ranks concurrently, each run rendezvousing on its own
loopback port. Every failed or errored test counts as a rendezvous failure (there must be
none); the session's total wall time is reported.

(b) Speed-up from ``-n 1`` to ``-n 2`` on a mixed suite of multirank and plain tests, rounds
interleaved, medians of the session walls.
"""

from __future__ import annotations

from collections import defaultdict

from _common import Report, Suite, interleaved, median, ms, parser, progress, ratio, repeats_of, sec, table, verdict
from _suites import MULTIRANK_TEST

PLAIN_TEST = """
import pytest
import torch


@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    t = torch.arange(4.0)
    assert t.sum().item() == 6.0
"""


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=2)
    p.add_argument("--stress", type=int, default=None, help="multirank tests in the stress session (default 500)")
    p.add_argument(
        "--stress-only",
        action="store_true",
        help="run only the stress session and exit non-zero on any rendezvous failure (what CI runs)",
    )
    args = p.parse_args()
    repeats = repeats_of(args)
    stress_n = args.stress or (40 if args.quick else 500)
    mixed_n = 10 if args.quick else 100
    report = Report("bench_xdist", "Multirank tests under pytest-xdist", args)
    files = {
        "stress/test_stress.py": MULTIRANK_TEST.format(n=stress_n),
        "mixed/test_multirank.py": MULTIRANK_TEST.format(n=mixed_n),
        "mixed/test_plain.py": PLAIN_TEST.format(n=mixed_n),
    }
    walls: dict[str, list[float]] = defaultdict(list)
    with Suite(files, keep=args.keep) as suite:
        # warm-up, not measured: .pyc files, page cache, one launcher per worker
        suite.run_ok("-n", "2", "mixed/test_multirank.py::test_multirank[0]", "mixed/test_plain.py", expect=1 + mixed_n)
        progress(f"stress: {stress_n} multirank tests under -n 2")
        stress = suite.run("-n", "2", "stress")
        if args.stress_only:
            bad = stress.bad + (stress_n - len(stress.cases))
            wall = stress.wall
            print(f"xdist stress: {stress_n} multirank tests under -n 2, {bad} rendezvous failures, {wall:.1f} s")
            if bad:
                print(stress.tail())
            raise SystemExit(1 if bad else 0)
        for r, w in interleaved(repeats, ["1", "2"]):
            progress(f"round {r + 1}/{repeats}: mixed suite, -n {w}")
            walls[w].append(suite.run_ok("-n", w, "mixed", expect=2 * mixed_n).wall)

    failures = stress.bad + (stress_n - len(stress.cases))  # a test missing from the xml counts too
    failed_names = [c.name for c in stress.cases if c.outcome in ("failed", "error")][:5]
    rows = [
        ["tests", stress_n],
        ["passed", stress.count("passed")],
        ["failed or error (rendezvous failures)", failures],
        ["pytest exit code", stress.returncode],
        ["session wall", sec(stress.wall)],
        ["session wall / tests (start-up included)", ms(stress.wall / stress_n)],
    ]
    notes = ["One session (not repeated): the count is what matters here."]
    if failed_names:
        notes.append("First failures: " + ", ".join(failed_names) + ". Output tail:\n\n```\n" + stress.tail() + "\n```")
    report.section(
        f"(a) Stress: {stress_n} multirank tests (world_size=2) under -n 2",
        table(["figure", "value"], rows)
        + "\n\n"
        + table(["target", "value", "met"], [["zero rendezvous failures", failures, verdict(failures == 0)]]),
        notes,
    )

    speedup = median(walls["1"]) / median(walls["2"])
    rows2 = [[f"-n {w}", repeats, sec(median(walls[w])), ms(median(walls[w]) / (2 * mixed_n))] for w in ("1", "2")]
    report.section(
        f"(b) Mixed suite: {mixed_n} multirank (2 ranks) + {mixed_n} plain tests",
        table(["xdist", "repeats", "session wall (median)", "wall / test"], rows2)
        + f"\n\nSpeed-up from -n 1 to -n 2: **{ratio(speedup)}**.",
        [
            "With -n 2 on 2 cores, two workers each fork 2 ranks: 4 busy rank processes compete for 2 cores"
            " during multirank tests, so the speed-up is bounded by the CPU, not by the plugin. Session"
            " walls include the workers' start (each imports torch).",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
