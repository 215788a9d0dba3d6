"""Per-test cost of 2-rank tests whose ranks make many lasting Python objects (a model, a
Trainer), with the ranks' collector leaving the fork server's objects alone (the default:
``launch/inherited_heap.py``) and without (``--ddp-freeze-inherited=off``).

A rank forked from the fork server shares its heap (torch and the test modules, about 200,000
objects); a collection of the oldest generation in the rank visits all of them and copies the
pages it writes. Each test here keeps K small objects alive until it ends (K = 0 is a trivial
test) and runs one barrier. Sessions of N and of 2N tests per K, frozen and not, alternate in
each round; a test's cost is the marginal one, (session with 2N - session with N) / N, of the
medians over rounds of the session's wall and of the CPU of every process.
"""

from __future__ import annotations

from _common import Report, Suite, interleaved, median, ms, parser, progress, repeats_of, table

HEAVY = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_heavy(i):
    kept = {body}
    dist.barrier()
    del kept  # only now
"""
# what each rank keeps alive until the test ends
BODIES = {
    "nothing (a trivial test)": "None",
    "20,000 dicts of a list (40,000 objects)": '[{{"i": [j]}} for j in range(20_000)]',
    "60,000 dicts of a list (120,000 objects)": '[{{"i": [j]}} for j in range(60_000)]',
    "a model of 1,500 blocks (4,500 modules)": (
        "torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8))"
        " for _ in range(1_500)])"
    ),
}

MODES = {"frozen": "on", "not frozen": "off"}


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=3)
    p.add_argument("--tests", type=int, default=None, help="tests per session (default 20; quick 4)")
    args = p.parse_args()
    repeats = repeats_of(args)
    n = args.tests or (4 if args.quick else 20)
    ks = list(range(len(BODIES)))
    report = Report("bench_heavy_ranks", "Ranks that make many objects: the inherited heap frozen or not", args)
    files = {
        f"test_heavy_{k}_{c}.py": HEAVY.format(n=c, body=body.format())
        for k, body in enumerate(BODIES.values())
        for c in (n, 2 * n)
    }
    walls: dict[tuple[str, int, int], list[float]] = {}
    cpus: dict[tuple[str, int, int], list[float]] = {}
    with Suite(files, keep=args.keep) as suite:
        suite.run_ok(f"test_heavy_0_{n}.py", expect=n)  # warm the page cache and .pyc files; not measured
        names = [f"{mode}|{k}|{c}" for k in ks for c in (n, 2 * n) for mode in MODES]
        for r, name in interleaved(repeats, names):
            mode, k, c = name.split("|")
            progress(f"round {r + 1}/{repeats}: {mode}, {list(BODIES)[int(k)]}, {c} tests")
            s = suite.run_ok(f"test_heavy_{k}_{c}.py", f"--ddp-freeze-inherited={MODES[mode]}", expect=int(c))
            walls.setdefault((mode, int(k), int(c)), []).append(s.wall)
            cpus.setdefault((mode, int(k), int(c)), []).append(s.cpu)

    def per_test(values: dict[tuple[str, int, int], list[float]], mode: str, k: int) -> float:
        return (median(values[mode, k, 2 * n]) - median(values[mode, k, n])) / n

    rows = []
    for k in ks:
        frozen_wall = per_test(walls, "frozen", k)
        thawed_wall = per_test(walls, "not frozen", k)
        frozen_cpu = per_test(cpus, "frozen", k)
        thawed_cpu = per_test(cpus, "not frozen", k)
        rows.append(
            [
                list(BODIES)[k],
                ms(thawed_wall),
                ms(frozen_wall),
                f"{frozen_wall / thawed_wall:.2f}x" if thawed_wall > 0 else "",
                ms(thawed_cpu),
                ms(frozen_cpu),
            ]
        )
    report.section(
        f"Per 2-rank test, marginal (sessions of {n} and {2 * n} tests), {repeats} rounds",
        table(
            [
                "what each rank keeps alive",
                "wall, not frozen",
                "wall, frozen (default)",
                "frozen / not",
                "CPU, not frozen",
                "CPU, frozen",
            ],
            rows,
        ),
        notes=[
            "CPU is that of every process of the session (pytest, the fork server, the ranks), per test.",
            "A rank collects its oldest generation once the objects it keeps pass a quarter of those it"
            " inherited (about 200,000 here): the trivial test never does, the others once or more.",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
