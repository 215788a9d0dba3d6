"""Per-test cost of a trivial 2-rank test: this plugin vs PyTorch's own multi-process test cases.

The same test (one ``dist.all_reduce`` of a 1-element tensor on a gloo group of 2 ranks, the
result asserted) is written three ways and run N times in a pytest session of its own:

- plugin: ``@pytest.mark.multirank(world_size=2)`` parametrized N times (fresh ranks per
  test, forked from the warm launcher);
- MultiProcessTestCase (torch.testing._internal.common_distributed): 2 fresh *spawned*
  interpreters per test, group initialised from a FileStore (fresh ranks per test);
- MultiProcContinuousTest (same module): 2 spawned workers per class, reused by every
  test of the class, one group for all (no isolation between tests).

The torch variants run with ``-p no:ddphooks`` (for fairness; MultiProcContinuousTest also
cannot run under the plugin's default leak guard, which takes the workers spawned in the first
test's ``setUp`` for a leak of that test and kills them). Startup (an empty session importing the same
modules) is measured separately per variant and subtracted before dividing by N.
A second table gives the plugin's per-test cost at world sizes 1, 2, 4, 8.

The latency tables set a trivial fresh-rank test (one barrier) beside the naive floor
(``_floor.py``: a forkserver with torch preloaded forking fresh ranks that initialise gloo, run
one barrier and destroy the group), at 2 and 8 ranks, with the next test's ranks prepared
while a test runs (the default) and without (``--ddp-prepare=off``); and time a suite of
trivial 2-rank tests under ``pytest -n 2``.
"""

from __future__ import annotations

import re
from collections import defaultdict

from _common import Report, Suite, interleaved, median, ms, parser, progress, ratio, repeats_of, sec, table, verdict
from _floor import floor_per_test
from _suites import MULTIRANK_TEST

PLUGIN_SIZES = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("i", range({n}))
@pytest.mark.multirank(world_size={sizes})
def test_all_reduce(i, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == float(world_size)
"""

BARRIER_TEST = """
import pytest
import torch.distributed as dist


@pytest.mark.multirank(world_size={size})
@pytest.mark.parametrize("i", range({n}))
def test_barrier(i):
    dist.barrier()
"""

PLUGIN_EMPTY = """
import pytest
import torch
import torch.distributed as dist
"""

TORCH_EMPTY = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest, MultiProcessTestCase
"""

MPTC_TEST = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestAllReduce(MultiProcessTestCase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @property
    def world_size(self) -> int:
        return 2

    def _all_reduce(self) -> None:
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)
{methods}
"""

MPC_TEST = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest


class TestAllReduce(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    def _all_reduce(self) -> None:
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)
{methods}
"""

METHOD = """
    def test_all_reduce_{i}(self) -> None:
        self._all_reduce()
"""

VARIANTS = {
    "plugin": ("pytest-ddphooks `multirank(world_size=2)`", True, "plugin"),
    "mptc": ("torch `MultiProcessTestCase` (spawn per test)", False, "torch"),
    "mpc": ("torch `MultiProcContinuousTest` (reused workers)", False, "torch"),
}


def files(counts: list[int], size_n: int, sizes: list[int]) -> dict[str, str]:
    out = {
        "test_empty_plugin.py": PLUGIN_EMPTY,
        "test_empty_torch.py": TORCH_EMPTY,
        "test_sizes.py": PLUGIN_SIZES.format(n=size_n, sizes=sizes),
    }
    for n in counts:
        methods = "".join(METHOD.format(i=i) for i in range(n))
        out[f"test_plugin_{n}.py"] = MULTIRANK_TEST.format(n=n)
        out[f"test_mptc_{n}.py"] = MPTC_TEST.format(methods=methods)
        out[f"test_mpc_{n}.py"] = MPC_TEST.format(methods=methods)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=3)
    p.add_argument("--counts", default=None, help="numbers of tests per session (default 10,50; quick 3,10)")
    p.add_argument(
        "--mptc-counts",
        default=None,
        help="which of --counts MultiProcessTestCase also runs at (default all; quick 3): it costs ~4 s a test",
    )
    p.add_argument("--mptc-repeats", type=int, default=1, help="repeats of the (slow) MultiProcessTestCase sessions")
    p.add_argument("--size-tests", type=int, default=None, help="tests per world size (default 30; quick 5)")
    p.add_argument("--size-repeats", type=int, default=None, help="repeats of the world-size session (default 2)")
    p.add_argument(
        "--only-latency",
        action="store_true",
        help="only the latency tables (floor, prepared ranks, -n 2 suite); page bench_multirank_latency.md",
    )
    args = p.parse_args()
    repeats = repeats_of(args)
    counts = [int(x) for x in (args.counts or ("3,10" if args.quick else "10,50")).split(",")]
    mptc_counts = [int(x) for x in (args.mptc_counts or ("3" if args.quick else ",".join(map(str, counts)))).split(",")]
    size_n = args.size_tests or (5 if args.quick else 30)
    size_repeats = args.size_repeats or (1 if args.quick else 2)
    sizes = [1, 2, 4, 8]
    if args.only_latency:
        report = Report("bench_multirank_latency", "Fresh-rank latency against the naive floor", args)
        latency(report, args)
        report.write()
        return
    report = Report("bench_multirank", "Per-test cost of multi-rank tests", args)

    walls: dict[tuple[str, int], list[float]] = defaultdict(list)  # (variant, n) -> session walls
    cpus: dict[tuple[str, int], list[float]] = defaultdict(list)
    calls: dict[tuple[str, int], list[float]] = defaultdict(list)  # junit durations (setup+call+teardown), pooled
    startup: dict[str, list[float]] = defaultdict(list)
    startup_cpu: dict[str, list[float]] = defaultdict(list)
    by_size: dict[int, list[float]] = defaultdict(list)

    def wanted(r: int, name: str, n: int) -> bool:
        if name == "mptc":
            return r < args.mptc_repeats and n in mptc_counts
        return True

    with Suite(files(counts, size_n, sizes), keep=args.keep) as suite:
        # warm the page cache and .pyc files once; not measured
        suite.run_ok("test_empty_plugin.py", expect=0)
        suite.run_ok("test_empty_torch.py", expect=0, plugin=False)
        for r, name in interleaved(repeats, ["startup-plugin", "startup-torch", *VARIANTS, "sizes"]):
            if name.startswith("startup-"):
                kind = name.removeprefix("startup-")
                progress(f"round {r + 1}/{repeats}: empty {kind} session")
                s = suite.run_ok(f"test_empty_{kind}.py", expect=0, plugin=kind == "plugin")
                startup[kind].append(s.wall)
                startup_cpu[kind].append(s.cpu)
                continue
            if name == "sizes":
                if r >= size_repeats:
                    continue
                progress(f"round {r + 1}/{repeats}: plugin at world sizes {sizes}, {size_n} tests each")
                s = suite.run_ok("test_sizes.py", expect=size_n * len(sizes))
                for case in s.cases:
                    m = re.search(r"\[\d+-(\d+)\]", case.name)
                    assert m is not None, case.name
                    by_size[int(m.group(1))].append(case.seconds)
                continue
            plugin = VARIANTS[name][1]
            for n in counts:
                if not wanted(r, name, n):
                    continue
                progress(f"round {r + 1}/{repeats}: {name}, {n} tests")
                s = suite.run_ok(f"test_{name}_{n}.py", expect=n, plugin=plugin)
                walls[name, n].append(s.wall)
                cpus[name, n].append(s.cpu)
                calls[name, n].extend(s.durations())

    def per_test(name: str, n: int) -> float:
        return (median(walls[name, n]) - median(startup[VARIANTS[name][2]])) / n

    def cpu_per_test(name: str, n: int) -> float:
        return (median(cpus[name, n]) - median(startup_cpu[VARIANTS[name][2]])) / n

    rows: list[list[object]] = []
    for name, (label, _, kind) in VARIANTS.items():
        for n in counts:
            if not walls[name, n]:
                rows.append([label, n, 0, "not run", "", "", "", ""])
                continue
            rows.append(
                [
                    label,
                    n,
                    len(walls[name, n]),
                    sec(median(walls[name, n])),
                    sec(median(startup[kind])),
                    ms(per_test(name, n)),
                    ms(median(calls[name, n])),
                    ms(cpu_per_test(name, n)),
                ]
            )
    report.section(
        "Trivial 2-rank tests (one all_reduce each), N per session",
        table(
            [
                "variant",
                "N",
                "repeats",
                "session wall (median)",
                "empty-session wall",
                "per test: (wall - empty) / N",
                "per test: junit median",
                "CPU per test (all processes)",
            ],
            rows,
        ),
        [
            "session wall: time.perf_counter() around the pytest subprocess; empty session: a module with the"
            " variant's imports and no test (the plugin's warm launcher is not started there, so its start-up"
            " is part of the per-test figure).",
            "junit median: the `time` of each testcase in --junitxml with junit_duration_report=total"
            " (setup, call and teardown: a multirank test forks and sets up its ranks in its setup phase),"
            " pooled over repeats. MultiProcContinuousTest spawns its workers in the first test's call and"
            " joins them in the last test's teardown, so its median hides that cost; the wall figure holds it.",
            "CPU: user+sys of the whole process tree of the session (RUSAGE_CHILDREN), minus the empty"
            " session's, divided by N.",
        ],
    )

    small, big = min(counts), max(counts)
    slopes: dict[str, float] = {}
    if big > small:
        slope_rows = []
        for name, (label, _, _) in VARIANTS.items():
            if walls[name, big] and walls[name, small]:
                slopes[name] = (median(walls[name, big]) - median(walls[name, small])) / (big - small)
                slope_rows.append([label, ms(slopes[name])])
        report.section(
            f"Marginal cost of one more test: (wall at N={big} - wall at N={small}) / {big - small}",
            table(["variant", "marginal per-test wall"], slope_rows),
            [
                "The slope between the two session sizes: start-up (interpreter, imports, the plugin's launcher,"
                " MultiProcContinuousTest's worker spawn) cancels out, as does the noise of the empty-session"
                " estimate; what is left is the steady per-test cost.",
            ],
        )

    checks: list[list[object]] = []
    for n in counts:
        if not walls["mptc", n]:
            continue
        x = per_test("mptc", n) / per_test("plugin", n)
        checks.append([f"per test (wall), plugin vs MultiProcessTestCase, N={n}", ratio(x), ">= 25x", verdict(x >= 25)])
        x = median(calls["mptc", n]) / median(calls["plugin", n])
        checks.append([f"per test (junit median), same, N={n}", ratio(x), ">= 25x", verdict(x >= 25)])
    if "mptc" in slopes:
        x = slopes["mptc"] / slopes["plugin"]
        checks.append([f"marginal per test, same, N={small}..{big}", ratio(x), ">= 25x", verdict(x >= 25)])
    total_x = median(walls["mpc", big]) / median(walls["plugin", big])
    net_x = (median(walls["mpc", big]) - median(startup["torch"])) / (
        median(walls["plugin", big]) - median(startup["plugin"])
    )
    checks.append(
        [f"total session, plugin vs MultiProcContinuousTest, N={big}", ratio(total_x), "> 1x", verdict(total_x > 1)]
    )
    checks.append([f"same, empty-session time subtracted from both, N={big}", ratio(net_x), "(information)", ""])
    med = median(calls["plugin", big])
    checks.append([f"plugin per-test junit median, 2 ranks, N={big}", ms(med), "<= 80 ms", verdict(med <= 0.080)])
    wall_pt = per_test("plugin", big)
    checks.append(
        [f"plugin per-test wall (incl. launcher start), N={big}", ms(wall_pt), "<= 80 ms", verdict(wall_pt <= 0.080)]
    )
    report.section(
        "Ratios and targets",
        table(["figure", "value", "target", "met"], checks),
        ["Ratios are of medians: how many times the plugin is faster (> 1x: the plugin wins)."],
    )

    size_rows = []
    for size in sizes:
        d = sorted(by_size[size])
        p90 = d[min(len(d) - 1, int(0.9 * len(d)))]
        size_rows.append([size, len(d), ms(median(d)), ms(p90), ms(d[0])])
    report.section(
        f"Plugin per-test cost by world size ({size_n} tests per size per session)",
        table(["world size", "samples", "junit median", "p90", "min"], size_rows),
        [
            "One session holds every size, interleaved (test i runs at sizes 1, 2, 4, 8 before test i+1),"
            f" run {size_repeats} time(s); each test does one all_reduce and asserts it. Its duration covers"
            " forking the ranks from the warm launcher, the rendezvous, the group, the body, the exit"
            " barrier and collecting results. On a machine with fewer cores than ranks, the ranks of one"
            " test share the cores.",
        ],
    )
    latency(report, args)
    report.write()


# targets of the latency issue: the prepared per-test cost against the naive floor
FLOOR_TARGETS = {2: 0.2, 8: 0.25}
XDIST_TARGET = 12.0


def latency(report: Report, args: object) -> None:
    """Fresh-rank tests against the naive floor, and a large suite under xdist.

    The floor and the plugin's sessions are measured round by round, side by side, and the
    ratio is taken within each round: on a shared 2-core machine the floor alone moved by a
    third between runs an hour apart, which a ratio of separate medians would carry."""
    quick = bool(getattr(args, "quick", False))
    per_size = {2: 10 if quick else 40, 8: 5 if quick else 20}
    rounds = 1 if quick else 5
    xdist_n = 100 if quick else 500
    xdist_repeats = 1 if quick else 3
    files = {
        f"test_barrier_{ws}_{n}.py": BARRIER_TEST.format(size=ws, n=n) for ws, k in per_size.items() for n in (k, 2 * k)
    }
    files[f"test_xdist_{xdist_n}.py"] = BARRIER_TEST.format(size=2, n=xdist_n)
    rows: list[list[object]] = []
    checks: list[list[object]] = []
    with Suite(files, keep=bool(getattr(args, "keep", False))) as suite:
        for ws, k in per_size.items():
            floors: list[float] = []
            marginal: dict[str, list[float]] = {"on": [], "off": []}
            junit: dict[str, list[float]] = {"on": [], "off": []}
            ratios: list[float] = []
            for r in range(rounds):
                progress(f"round {r + 1}/{rounds}: naive floor at {ws} ranks, {k} tests")
                floors.append(floor_per_test(ws, k))
                for mode in ("on", "off"):
                    walls = {}
                    for n in (k, 2 * k):
                        progress(f"round {r + 1}/{rounds}: {ws} ranks, --ddp-prepare={mode}, {n} tests")
                        session = suite.run_ok(f"test_barrier_{ws}_{n}.py", f"--ddp-prepare={mode}", expect=n)
                        walls[n] = session.wall
                        junit[mode].extend(session.durations())
                    marginal[mode].append((walls[2 * k] - walls[k]) / k)
                ratios.append(marginal["on"][-1] / floors[-1])
            x = median(ratios)
            rows.append(
                [
                    ws,
                    ms(median(floors)),
                    ms(median(marginal["on"])),
                    ms(median(junit["on"])),
                    f"{x:.2f}x ({min(ratios):.2f}..{max(ratios):.2f})",
                    ms(median(marginal["off"])),
                    ms(median(junit["off"])),
                ]
            )
            target = FLOOR_TARGETS[ws]
            checks.append(
                [
                    f"{ws} ranks: prepared per-test cost / naive floor (median of {rounds} rounds)",
                    f"{x:.2f}x",
                    f"<= {target}x",
                    verdict(x <= target),
                ]
            )
        walls_n2: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(xdist_repeats):
            for mode in ("on", "off") if r == 0 else ("on",):
                progress(f"{xdist_n} trivial 2-rank tests under -n 2, --ddp-prepare={mode} ({r + 1}/{xdist_repeats})")
                session = suite.run_ok(f"test_xdist_{xdist_n}.py", "-n", "2", f"--ddp-prepare={mode}", expect=xdist_n)
                walls_n2[mode].append(session.wall)
        on = median(walls_n2["on"])
        checks.append(
            [
                f"{xdist_n} trivial 2-rank tests, -n 2, session wall (median of {xdist_repeats})",
                f"{sec(on)} ({', '.join(sec(w) for w in walls_n2['on'])})",
                f"<= {XDIST_TARGET:g} s" if xdist_n == 500 else "(quick run)",
                verdict(on <= XDIST_TARGET) if xdist_n == 500 else "",
            ]
        )
        checks.append(["same, --ddp-prepare=off (one run)", sec(median(walls_n2["off"])), "(information)", ""])
    report.section(
        "Fresh-rank latency against the naive floor (one barrier per test)",
        table(
            [
                "world size",
                "naive floor (median)",
                "plugin, prepared: marginal per test",
                "plugin, prepared: junit median",
                "prepared / floor (median of rounds; range)",
                "plugin, --ddp-prepare=off: marginal",
                "--ddp-prepare=off: junit median",
            ],
            rows,
        ),
        [
            "naive floor: benchmarks/_floor.py, a multiprocessing forkserver with torch and torch.distributed"
            " preloaded; per test it starts world-size processes that init a gloo group (tcp://), barrier,"
            " destroy it; the time from the first start to the last join, median over the tests.",
            "marginal per test: (session wall with 2N tests - session wall with N tests) / N: the steady"
            " cost of one more test, start-up cancelled; medians over the rounds.",
            "rounds: each measures the floor, then the plugin's four sessions, and gives its own ratio"
            " (prepared marginal / that round's floor); the table gives their median and range.",
            "junit median: setup+call+teardown of each test (the ranks prepared ahead of a test are not in"
            " it unless the test had to wait for them).",
        ],
    )
    report.section("Latency targets", table(["figure", "value", "target", "met"], checks))


if __name__ == "__main__":
    main()
