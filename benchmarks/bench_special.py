"""Special tests (each in a fresh interpreter) under pytest-xdist: ``-n 1`` vs ``-n 2``.

A suite of trivially passing ``@pytest.mark.special`` tests, each importing torch (already
imported by the plugin at the start of every pytest interpreter), is run with one and with two
xdist workers, rounds interleaved; the speed-up is the ratio of the median session walls.
"""

from __future__ import annotations

from collections import defaultdict

from _common import Report, Suite, interleaved, median, ms, parser, progress, ratio, repeats_of, sec, table

SPECIAL_TEST = """
import pytest


@pytest.mark.special
@pytest.mark.parametrize("i", range({n}))
def test_special(i):
    import torch

    assert torch.ones(1).item() == 1.0
"""


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=2)
    args = p.parse_args()
    repeats = repeats_of(args)
    n = 4 if args.quick else 20
    report = Report("bench_special", "Special tests under xdist", args)
    walls: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[float]] = defaultdict(list)
    workers = ["1", "2"]
    with Suite({"test_special.py": SPECIAL_TEST.format(n=n)}, keep=args.keep) as suite:
        suite.run_ok("-n", "1", "test_special.py::test_special[0]", expect=1)  # warm-up, not measured
        for r, w in interleaved(repeats, workers):
            progress(f"round {r + 1}/{repeats}: -n {w}")
            s = suite.run_ok("-n", w, "test_special.py", expect=n)
            walls[w].append(s.wall)
            cpus[w].append(s.cpu)
    rows = [
        [f"-n {w}", repeats, sec(median(walls[w])), ms(median(walls[w]) / n), sec(median(cpus[w]))] for w in workers
    ]
    speedup = median(walls["1"]) / median(walls["2"])
    report.section(
        f"{n} special tests (each passes trivially, importing torch)",
        table(["xdist", "repeats", "session wall (median)", "wall / test", "CPU, all processes (median)"], rows)
        + f"\n\nSpeed-up from -n 1 to -n 2: **{ratio(speedup)}** (ideal on 2 cores: 2x).",
        [
            "Each special test starts `python -m pytest` on its file in a fresh interpreter, which imports"
            " torch (the plugin does, at start-up) and collects the module: that start-up is nearly all of"
            " a special test's cost, and it is CPU-bound, so -n 2 cannot beat the number of cores.",
            "The sessions include xdist's own start (one worker interpreter per -n, each importing torch)."
            " CPU: user+sys of every process of the session (RUSAGE_CHILDREN).",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
