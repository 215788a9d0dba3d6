"""A big Timeline builds its clocks (no timing asserted: benchmarks/bench_recorder.py times it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_recorder import big_raw

from pytest_ddphooks.recorder import Timeline


def test_eight_ranks_of_ten_thousand_events_build_their_clocks() -> None:
    raw = big_raw(ranks=8, per_rank=10_000, every=10)
    tl = Timeline.from_raw(raw)
    assert tl.ranks == list(range(8))
    assert all(len(tl.for_rank(r)) == 10_000 for r in tl.ranks)
    assert len(tl.instances) == 1000
    clocks = tl.clocks
    assert len(clocks.lanes) == 8
    first = tl.for_rank(0)[0]
    last = tl.for_rank(7)[-1]
    assert clocks.happens_before(first, last)
    assert not clocks.happens_before(last, first)
    # the last all_reduce synchronised everybody: rank 3's last step start reaches rank 5's last end
    start3 = tl.for_rank(3)[-2]
    end5 = tl.for_rank(5)[-1]
    assert start3.name == "dist.all_reduce" and clocks.happens_before(start3, end5)
    assert tl.collective_mismatches() == []
