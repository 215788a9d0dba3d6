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


def _random_raw(seed: int, ranks: int = 3, lanes: int = 2, steps: int = 60) -> dict[int, list]:
    """Marks 'a' and 'b' and calls 'c' on several threads of each rank, with barriers on the
    default group now and then (on lane 0), and a call 'c' left open on some ranks."""
    import random

    from pytest_ddphooks.recorder import events

    rng = random.Random(seed)
    out: dict[int, list] = {}
    for r in range(ranks):
        raw: list = []
        seq = 0
        for call_id in range(1, steps + 1):
            t = 2 * call_id
            lane = rng.randrange(lanes)
            roll = rng.random()
            if roll < 0.15:
                seq += 1
                info = {"op": "barrier", "group_existed": True, "group": "default", "group_size": ranks, "seq": seq}
                raw.append((call_id, t, 0, events.COLLECTIVE, events.START, "dist.barrier", info))
                raw.append((call_id, t + 1, 0, events.COLLECTIVE, events.END, "dist.barrier", None))
            elif roll < 0.6:
                raw.append((call_id, t, lane, events.MARK, events.POINT, rng.choice("ab"), None))
            else:
                raw.append((call_id, t, lane, events.CALL, events.START, "c", None))
                if rng.random() < 0.95:
                    raw.append((call_id, t + 1, lane, events.CALL, events.END, "c", None))
        out[r] = raw
    # every rank takes part in as many barriers
    fewest = min(sum(1 for e in raw if e[5] == "dist.barrier" and e[4] == events.START) for raw in out.values())
    for r, raw in out.items():
        seen = 0
        kept = []
        for e in raw:
            if e[5] == "dist.barrier":
                if e[4] == events.START:
                    seen += 1
                if seen > fewest:
                    continue
            kept.append(e)
        out[r] = kept
    return out


def test_the_pairs_happens_before_refuses_are_those_of_the_pair_by_pair_check() -> None:
    # the bisection over each lane finds exactly what comparing every pair finds, in its order
    for seed in range(40):
        tl = Timeline.from_raw(_random_raw(seed))
        for a, b in (("a", "b"), ("b", "a"), ("c", "b"), ("a@0", "c@1,2"), ("c", "c"), ("a@2", "a@0")):
            first, then = tl._select(a)[2], tl._select(b)[2]
            pairs = [
                (x, y) for x in first for y in then if x.end is None or not tl.clocks.happens_before(x.end, y.start)
            ]
            bad, total = tl._violations(first, then, keep=5)
            assert (bad, total) == (pairs[:5], len(pairs)), (seed, a, b)
            assert tl.happens_before(a, b) == (bool(first and then) and not pairs)


def test_happens_before_between_thousands_of_events_a_rank_checks_lane_by_lane() -> None:
    # 5,000 'load' then a barrier then 5,000 'step' on each of 2 ranks: 100,000,000 pairs one by
    # one; found through a few hundred thousand comparisons
    from pytest_ddphooks.recorder import events

    raw: dict[int, list] = {}
    for r in range(2):
        marks = [(i, i, 0, events.MARK, events.POINT, "load", None) for i in range(5000)]
        info = {"op": "barrier", "group_existed": True, "group": "default", "group_size": 2, "seq": 1}
        sync = [
            (5000, 5000, 0, events.COLLECTIVE, events.START, "dist.barrier", info),
            (5000, 5001, 0, events.COLLECTIVE, events.END, "dist.barrier", None),
        ]
        steps = [(5001 + i, 5002 + i, 0, events.MARK, events.POINT, "step", None) for i in range(5000)]
        raw[r] = marks + sync + steps
    tl = Timeline.from_raw(raw)
    calls = 0
    compare = tl.clocks.happens_before

    def counted(a, b):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return compare(a, b)

    tl.clocks.happens_before = counted  # type: ignore[method-assign]
    tl.assert_happens_before("load", "step")
    assert calls < 500_000
    try:
        tl.assert_happens_before("step@0", "load@1")
    except AssertionError as exc:
        assert "... and 24999997 more pairs" in str(exc)
    else:
        raise AssertionError("a step after the barrier happened before a load before it")
