"""Cost of armed faults that do not fire: per recorded event, with no fault armed, with a fault
armed for another rank only, and with 1 and 8 faults armed on this rank that never fire.

In-process, as in a rank: a Recorder writing to its crash-safe event file, and the ``Faults``
object the ``faults`` fixture gives a rank (rank 0 of 2). Events are marks (one event each)
and calls of an instrumented method (a start and an end event each); every variant is timed
in the same rounds, interleaved, and the per-event figure is the median over rounds of the
best-of-three per round. The fault points name an event kind the loop also records
(``mark:never``, ``start:never``), so every event is compared with every armed point.
"""

from __future__ import annotations

import os
import tempfile
import timeit
from collections.abc import Callable
from typing import Any

from _common import Report, median, parser, progress, table, verdict

from pytest_ddphooks import Recorder
from pytest_ddphooks.faults import Faults


class Model:
    def step(self, x: int) -> int:
        return x + 1


VARIANTS = {
    "no fault armed": lambda faults: None,
    "1 fault armed for rank 1 (none here)": lambda faults: faults.kill(rank=1, at="mark:never"),
    "1 fault armed here, never fires": lambda faults: faults.kill(rank=0, at="mark:never"),
    "8 faults armed here, never fire": lambda faults: [
        faults.delay(rank=0, at=f"{kind}:never#{n}", seconds=0.1) for kind in ("mark", "start") for n in (1, 2, 3, 4)
    ],
}


def _setup(folder: str, arm: Callable[[Faults], Any]) -> tuple[Recorder, Model]:
    rec = Recorder(0, 2, event_file=os.path.join(folder, f"events-{len(os.listdir(folder))}"))
    arm(Faults(0, 2, rec))
    model = rec.instrument(Model(), "step")
    return rec, model


def per_event(number: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """variant -> {"mark": seconds per event per round, "call": ...}."""
    out: dict[str, dict[str, list[float]]] = {v: {"mark": [], "call": []} for v in VARIANTS}
    with tempfile.TemporaryDirectory() as folder:
        setups = {v: _setup(folder, arm) for v, arm in VARIANTS.items()}
        for r in range(rounds):
            progress(f"round {r + 1}/{rounds}")
            for variant, (rec, model) in setups.items():
                mark = min(timeit.repeat(lambda rec=rec: rec.mark("m"), number=number, repeat=3)) / number
                call = min(timeit.repeat(lambda model=model: model.step(1), number=number, repeat=3)) / number
                out[variant]["mark"].append(mark)
                out[variant]["call"].append(call / 2)  # a start and an end event
                rec._raw.clear()  # only the memory: the per-event work does not depend on it
        for rec, _ in setups.values():
            rec.close()
    return out


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} µs"  # the difference is a fraction of a microsecond


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=7)
    args = p.parse_args()
    rounds = 3 if args.quick else args.repeats or 7
    number = 5_000 if args.quick else 20_000
    report = Report("bench_faults", "Faults: cost of armed faults that never fire", args)
    found = per_event(number, rounds)
    base = {kind: median(found["no fault armed"][kind]) for kind in ("mark", "call")}
    rows = []
    for variant, kinds in found.items():
        mark, call = median(kinds["mark"]), median(kinds["call"])
        added = max(mark - base["mark"], call - base["call"])
        rows.append([variant, us(mark), us(call), us(added), "<= 2 µs", verdict(added <= 2e-6)])
    report.section(
        f"Per recorded event ({rounds} rounds x best of 3 x {number} events, rank 0 of 2, event file on)",
        table(
            [
                "variant",
                "mark (1 event)",
                "instrumented call, per event (2 events)",
                "added per event (worse of the two)",
                "target",
                "met",
            ],
            rows,
        ),
        [
            "The cost of a fault armed for another rank is nothing at all: arming it here records"
            " nothing and installs no trigger (the row measures the same code path as no fault).",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
