"""``python -m reference_trainer``: fit the regression task and show the hook lifecycle."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .bugs import BUGS
from .strategies import STRATEGIES
from .task import RegressionDataModule, RegressionModule
from .trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference_trainer", description=__doc__)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to launch (ddp, ddp_spawn, fsdp)")
    parser.add_argument("--nodes", type=int, default=1, help="simulated nodes the ranks are split over")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prepare-data-per-node", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--bug", action="append", default=[], choices=sorted(BUGS), help="seed a bug (repeatable)")
    parser.add_argument("--data-dir", default=None, help="where prepare_data writes (default: a fresh temp folder)")
    parser.add_argument("--trace", default=None, help="Chrome trace JSON to write (default traces/<strategy>.json)")
    parser.add_argument("--rows", type=int, default=None, help="at most this many swimlane rows")
    parser.add_argument("--timeout", type=float, default=120.0, help="process group and launch timeout, seconds")
    args = parser.parse_args(argv)

    world_size = None if args.strategy in ("single", "external") else args.world_size
    trainer = Trainer(
        args.strategy,
        max_epochs=args.epochs,
        prepare_data_per_node=args.prepare_data_per_node,
        world_size=world_size,
        num_nodes=args.nodes,
        batch_size=args.batch_size,
        seed=args.seed,
        bugs=args.bug,
        record=True,
        timeout=args.timeout,
    )
    result = trainer.fit(RegressionModule(), RegressionDataModule(args.data_dir))
    if min(result.ranks) != 0:
        return 0  # an externally launched rank other than 0: rank 0 reports
    timeline = result.timeline
    assert timeline is not None
    print(f"strategy {args.strategy}, world size {result.world_size}, {len(result.losses)} steps per rank")
    print(f"loss: first step {result.initial_loss:.4f}, last step {result.final_loss:.4f}")
    print()
    print(timeline.swimlanes(max_rows=args.rows))
    trace = args.trace or os.path.join("traces", f"{args.strategy}.json")
    os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
    written = timeline.to_chrome_trace(trace)
    print(f"\nChrome trace: {written} (open in chrome://tracing or https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
