"""Timing of the recorder, reported and never asserted on: ``python tests/recorder/perf.py``.

``big_raw`` is also used by the performance smoke test (which only checks the result).
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import timeit
from typing import Any

from pytest_ddphooks.recorder import Recorder, Timeline, events
from pytest_ddphooks.recorder.events import RawEvent


def big_raw(ranks: int = 8, per_rank: int = 10_000, every: int = 10) -> dict[int, list[RawEvent]]:
    """``per_rank`` events per rank; every ``every`` events, a barrier on the default group."""
    out: dict[int, list[RawEvent]] = {}
    for r in range(ranks):
        raw: list[RawEvent] = []
        call_id = 0
        seq = 0
        t = 0
        while len(raw) < per_rank:
            for _ in range((every - 2) // 2):
                call_id += 1
                t += 10
                raw.append((call_id, t, 0, events.CALL, events.START, "step", {"qualname": "T.step"}))
                t += 10
                raw.append((call_id, t, 0, events.CALL, events.END, "step", None))
            call_id += 1
            seq += 1
            info = {"op": "all_reduce", "group_existed": True, "group": "default", "group_size": ranks}
            info.update(seq=seq, payload="float32[4]", reduce_op="SUM")
            t += 10
            raw.append((call_id, t, 0, events.COLLECTIVE, events.START, "dist.all_reduce", info))
            t += 10
            raw.append((call_id, t, 0, events.COLLECTIVE, events.END, "dist.all_reduce", None))
        out[r] = raw[:per_rank]
    return out


def _best(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def timeline_seconds(ranks: int = 8, per_rank: int = 10_000, every: int = 10) -> dict[str, float]:
    """Seconds to merge (from_raw), group the collectives, and build the vector clocks."""
    raw = big_raw(ranks, per_rank, every)
    result: dict[str, float] = {}
    result["from_raw"] = _best(lambda: Timeline.from_raw(raw))
    tl = Timeline.from_raw(raw)

    def instances() -> None:
        tl.__dict__.pop("instances", None)
        assert tl.instances

    def clocks() -> None:
        tl.__dict__.pop("clocks", None)
        assert tl.clocks is not None

    result["instances"] = _best(instances)
    result["clocks"] = _best(clocks)

    def everything() -> None:
        t = Timeline.from_raw(raw)
        assert t.clocks is not None

    result["merge+clocks"] = _best(everything)
    return result


class _Hooks:
    def on_step(self, x: int) -> int:
        return x + 1


def per_call_seconds(n: int = 200_000) -> dict[str, float]:
    """Seconds per recorded event (mark), per instrumented call, and per bare call."""
    out: dict[str, float] = {}
    bare = _Hooks()
    out["bare call"] = min(timeit.repeat(lambda: bare.on_step(1), number=n, repeat=3)) / n
    with tempfile.TemporaryDirectory() as d:
        for label, path in (("memory", None), ("event file", os.path.join(d, "events"))):
            rec = Recorder(0, 1, event_file=path)
            try:
                out[f"mark ({label})"] = min(timeit.repeat(lambda rec=rec: rec.mark("m"), number=n, repeat=3)) / n
                obj = _Hooks()
                rec.instrument(obj)
                out[f"instrumented call ({label})"] = (
                    min(timeit.repeat(lambda obj=obj: obj.on_step(1), number=n, repeat=3)) / n
                )
            finally:
                rec.close()
    return out


def dist_call_seconds(n: int = 2000) -> dict[str, float]:
    """Seconds per ``dist.all_reduce`` on a world-size-1 gloo group, with and without a recorder."""
    from pytest_ddphooks.recorder import distpatch

    distpatch.install()
    import torch
    import torch.distributed as dist

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            t = torch.ones(4)
            original = dist.all_reduce.__ddphooks_original__  # type: ignore[attr-defined]
            out["all_reduce (unpatched)"] = min(timeit.repeat(lambda: original(t), number=n, repeat=3)) / n
            out["all_reduce (patched, no recorder)"] = (
                min(timeit.repeat(lambda: dist.all_reduce(t), number=n, repeat=3)) / n
            )
            with Recorder(0, 1, event_file=os.path.join(d, "events")):
                out["all_reduce (recorded to file)"] = (
                    min(timeit.repeat(lambda: dist.all_reduce(t), number=n, repeat=3)) / n
                )
        finally:
            dist.destroy_process_group()
    return out


def main() -> None:
    for k, v in dist_call_seconds().items():
        print(f"{k:32s} {v * 1e6:8.3f} us")
    for k, v in per_call_seconds().items():
        print(f"{k:32s} {v * 1e6:8.3f} us")
    for k, v in timeline_seconds().items():
        print(f"{k:32s} {v:8.3f} s")


if __name__ == "__main__":
    sys.exit(main())
