"""The recorder's cost: per recorded event, per instrumented call and per recorded
torch.distributed call against the bare call; merging 8 ranks x 10,000 events with their vector
clocks; FSDP2 steps recorded against not inside the same ranks (CPU and wall), and where the
recorder's time goes in them; a reference-trainer FSDP2 fit inside a multirank test recorded
against not; and reference-trainer fits of 400 steps recorded against not (wall and CPU).
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _common import Report, median, ms, parser, progress, repeats_of, table, us, verdict

from pytest_ddphooks.recorder import Recorder, Timeline, active, events
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


def _noop_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    return None


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
            # the recorder's own work, without a collective: its wrapper around a no-op that takes
            # all_reduce's arguments (so the call is described as a real one: its tensor is found)
            noop = distpatch._wrap_function("all_reduce", _noop_all_reduce)
            out["no-op in the all_reduce wrapper, no recorder"] = (
                min(timeit.repeat(lambda: noop(t), number=n, repeat=3)) / n
            )
            with Recorder(0, 1, event_file=os.path.join(d, "events")):
                out["all_reduce (recorded to file)"] = (
                    min(timeit.repeat(lambda: dist.all_reduce(t), number=n, repeat=3)) / n
                )
                unrecorded, recorded = _paired_thread_cpu(lambda: original(t), lambda: dist.all_reduce(t), n)
                out[CPU_UNRECORDED] = statistics.median(unrecorded)
                out[CPU_RECORDED] = statistics.median(recorded)
                out[CPU_ADDED] = statistics.median(r - u for r, u in zip(recorded, unrecorded, strict=True))
                out["no-op in the all_reduce wrapper, recorded to file"] = (
                    min(timeit.repeat(lambda: noop(t), number=n, repeat=3)) / n
                )
                # a long recording, the garbage collector's share included (the best-of rows leave it out)
                long = 100 * n
                started = time.thread_time()
                for _ in range(long):
                    noop(t)
                out[AMORTIZED.format(n=f"{long:,}")] = (time.thread_time() - started) / long
        finally:
            dist.destroy_process_group()
    return out


CPU_UNRECORDED = "all_reduce (unpatched), CPU of the calling thread"
CPU_RECORDED = "all_reduce (recorded to file), CPU of the calling thread"


CPU_ADDED = "recorded less unrecorded, CPU of the calling thread (median of paired rounds)"
AMORTIZED = "no-op in the all_reduce wrapper, recorded to file, over {n} calls in a row (thread CPU)"
PAIRED_ROUNDS = 9


def _paired_thread_cpu(
    unrecorded: Callable[[], Any], recorded: Callable[[], Any], n: int
) -> tuple[list[float], list[float]]:
    """CPU seconds of this thread per call, n calls unrecorded (recording suspended) then n
    recorded, in each of PAIRED_ROUNDS rounds: what gloo's own threads do and when the
    scheduler runs them are out of it, and each round's difference is taken within it (the
    machine's state drifts between rounds by more than the recorder costs)."""
    out: tuple[list[float], list[float]] = ([], [])
    for _ in range(PAIRED_ROUNDS):
        for i, call in enumerate((unrecorded, recorded)):
            log = active.suspended() if i == 0 else None
            started = time.thread_time()
            for _ in range(n):
                call()
            out[i].append((time.thread_time() - started) / n)
            if i == 0:
                active.resume(log)
    return out


def _cpu_seconds() -> float:
    """User + system CPU of this process and of its children that ended and were waited for
    (the ranks a trainer launched: it joins them)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def fit_seconds(strategy: str, record: str, epochs: int, batch_size: int, data_dir: str) -> tuple[float, float]:
    """Wall and CPU seconds of one fit of the reference trainer (CPU: this process and the ranks
    it launched). ``record``: "no"; "hooks" (every hook, the barriers, model_to_device,
    wrap_model, as ``Trainer(record=True)`` does; when the trainer launches ranks, each records
    to its crash-safe event file); "steps" (also every training_step)."""
    from reference_trainer import RegressionDataModule, RegressionModule, Trainer, instrument_trainer

    world = 2 if strategy != "single" else None
    launched = record != "no" and world is not None
    trainer = Trainer(strategy, max_epochs=epochs, batch_size=batch_size, world_size=world, record=launched)
    module, dm = RegressionModule(), RegressionDataModule(data_dir)
    started, cpu = time.perf_counter(), _cpu_seconds()
    if record != "no" and world is None:
        with Recorder(0, 1) as rec:
            instrument_trainer(rec, trainer, module, dm, steps=record == "steps")
            result = trainer.fit(module, dm)
            rec.timeline()
    else:
        result = trainer.fit(module, dm)
    elapsed, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    assert result.final_loss < result.initial_loss
    return elapsed, cpu


def _inner_session(source: str, tag: str, ranks: int) -> list[list[str]]:
    """Run ``source`` as a test file in a pytest session of its own (``-s``: ranks print live);
    the words after ``tag`` on each line a rank printed, one row per rank."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "test_inner.py")
        with open(path, "w") as f:
            f.write(source)
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", path],
            capture_output=True,
            text=True,
            cwd=d,
            check=False,
        ).stdout
    marker = tag + " "
    rows = [line[line.index(marker) :].split()[1:] for line in out.splitlines() if marker in line]
    if len(rows) != ranks:
        raise RuntimeError(f"the inner {tag} session did not report from every rank:\n{out[-3000:]}")
    return rows


LARGE = """
import resource
import time
import pytest

@pytest.mark.multirank(world_size={ranks}, timeout=900)
def test_large(rank, recorder):
    for _ in range({per_rank}):
        recorder.mark("tick")
    started = time.perf_counter()
    timeline = recorder.timeline()
    took = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"LARGE {{rank}} {{len(timeline.events)}} {{took:.3f}} {{rss}}")
"""


def large_timeline(ranks: int, per_rank: int) -> tuple[int, float, int]:
    """``recorder.timeline()`` in a multirank test whose ranks recorded ``per_rank`` events
    each: (events in the merged timeline, slowest rank's seconds, largest rank's max RSS MiB)."""
    rows = _inner_session(LARGE.format(ranks=ranks, per_rank=per_rank), "LARGE", ranks)
    return int(rows[0][1]), max(float(r[2]) for r in rows), max(int(r[3]) for r in rows)


# the FSDP2 model of both inner sessions (no braces: it goes into str.format templates)
FSDP_MODEL = """    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(8, 16)
"""

FSDP_STEPS = """
import json
import time
import pytest
import torch
import torch.distributed as dist
from pytest_ddphooks.recorder import active

@pytest.mark.multirank(world_size=2, timeout=1800)
def test_fsdp_steps(rank, recorder):
@FSDP_MODEL@

    def steps(n):
        # per step: wall seconds; CPU seconds of this whole rank process (every thread: gloo's
        # too); CPU seconds of this thread alone, where FSDP2 issues (and the recorder records)
        # every collective
        wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(n):
            # in every mode alike: the watchdog sees progress in an unrecorded block too, and
            # does not ask the rank for torch's flight recorder (20-190 ms of CPU an ask)
            recorder.mark("step")
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return (
            (time.perf_counter() - wall) / n,
            (time.process_time() - cpu) / n,
            (time.thread_time() - own) / n,
        )

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def with_busy_work(fn):
        # the control: plain CPU work before each collective, instead of recording it
        def busy(*args, **kwargs):
            spin({busy_us} / 1e6)
            return fn(*args, **kwargs)
        return busy

    plain = {{name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}}
    busy = {{name: with_busy_work(fn) for name, fn in plain.items()}}
    calls = {{"n": 0}}

    def counting(fn):
        def counted(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return counted

    log = active.suspended()
    assert log is recorder
    # how many all-gathers and reduce-scatters a step issues (what the control adds work to)
    for name, fn in plain.items():
        setattr(dist, name, counting(fn))
    steps({warmup})
    for name, fn in plain.items():
        setattr(dist, name, fn)
    wrapped_per_step = calls["n"] / {warmup}

    def run(mode):
        if mode == "on":
            active.resume(log)
        elif mode == "busy":
            for name, fn in busy.items():
                setattr(dist, name, fn)
        try:
            return steps({per_block})
        finally:
            active.suspended()
            for name, fn in plain.items():
                setattr(dist, name, fn)

    modes = ("on", "off", "busy")
    blocks = []
    recorded_steps = 0
    before = len(recorder.records())
    for b in range({blocks}):
        # every rank switches at the same step (the two ranks run in lockstep); the order of the
        # three modes rotates from block to block, so none always follows the same one
        order = modes[b % 3 :] + modes[: b % 3]
        blocks.append({{mode: run(mode) for mode in order}})
        recorded_steps += {per_block}
    # the calls recorded (not the marks, nor collectives read from the flight recorder later)
    recorded_calls = sum(
        1
        for e in recorder.records()[before:]
        if e[4] == "start" and e[3] not in ("mark", "meta") and not (e[6] or {{}}).get("native")
    )
    active.resume(log)
    out = {{
        "blocks": [{{m: [round(v, 9) for v in blk[m]] for m in modes}} for blk in blocks],
        "calls_per_step": recorded_calls / recorded_steps,
        "wrapped_per_step": wrapped_per_step,
    }}
    print(f"FSDP {{rank}} {{json.dumps(out, separators=(',', ':'))}}")
"""
FSDP_STEPS = FSDP_STEPS.replace("@FSDP_MODEL@\n", FSDP_MODEL)


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """The median and a 95% confidence interval of it (order statistics, binomial approximation)."""
    data = sorted(values)
    n = len(data)
    k = max(0, int((n - 1.96 * math.sqrt(n)) / 2))
    return statistics.median(data), data[k], data[n - 1 - k]


# the three clocks of FSDP_STEPS, by their index in each block's [wall, cpu, own] triple
CLOCKS = {"process CPU": 1, "main-thread CPU": 2, "wall": 0}


@dataclass
class Figure:
    """One ratio of FSDP_STEPS, less 1: per rank, the median over blocks of (mode / unrecorded);
    ``worse`` is the higher rank's, with its confidence interval."""

    per_rank: list[float]
    low: float
    high: float

    @property
    def worse(self) -> float:
        return max(self.per_rank)

    def cell(self) -> str:
        ranks = " / ".join(f"{v * 100:+.1f}%" for v in self.per_rank)
        return f"{self.worse * 100:+.1f}% (95% CI {self.low * 100:+.1f}..{self.high * 100:+.1f}; ranks {ranks})"


@dataclass
class FsdpRun:
    """One inner session of FSDP_STEPS."""

    recorded: dict[str, Figure]  # clock -> recorded / unrecorded
    control: dict[str, Figure]  # clock -> busy work instead of recording / unrecorded
    unrecorded: dict[str, float]  # clock -> seconds per unrecorded step (median of blocks, the higher rank)
    calls_per_step: float  # recorded calls per step (two events each)
    wrapped_per_step: float  # all-gathers and reduce-scatters per step (where the control spins)
    blocks: int
    per_block: int
    busy_us: float
    seconds: float

    def added_us(self, clock: str) -> float:
        """What recording added to a step, in microseconds of ``clock`` (worse rank)."""
        return self.recorded[clock].worse * self.unrecorded[clock] * 1e6

    def control_expected(self, clock: str) -> float:
        """The busy work's own share of an unrecorded step on ``clock``."""
        return self.busy_us * 1e-6 * self.wrapped_per_step / self.unrecorded[clock]


def fsdp_step_overhead(blocks: int, per_block: int, busy_us: float, warmup: int = 20) -> FsdpRun:
    """Alternating blocks of FSDP2 training steps on 2 ranks: recorded, not recorded, and with
    ``busy_us`` of plain busy work before each all-gather / reduce-scatter instead of recording
    (recording switched on and off inside the ranks, so launching them is not part of it).
    Per rank and clock, the median over blocks of each block's ratio to its unrecorded steps."""
    source = FSDP_STEPS.format(blocks=blocks, per_block=per_block, busy_us=busy_us, warmup=warmup)
    started = time.perf_counter()
    rows = _inner_session(source, "FSDP", 2)
    seconds = time.perf_counter() - started
    data = [json.loads(r[1]) for r in sorted(rows, key=lambda r: int(r[0]))]

    def figure(mode: str, i: int) -> Figure:
        per_rank = [[b[mode][i] / b["off"][i] - 1 for b in d["blocks"]] for d in data]
        medians = [median_ci(r) for r in per_rank]
        worse = max(range(len(medians)), key=lambda r: medians[r][0])
        return Figure([m[0] for m in medians], medians[worse][1], medians[worse][2])

    return FsdpRun(
        recorded={clock: figure("on", i) for clock, i in CLOCKS.items()},
        control={clock: figure("busy", i) for clock, i in CLOCKS.items()},
        unrecorded={clock: max(median(b["off"][i] for b in d["blocks"]) for d in data) for clock, i in CLOCKS.items()},
        calls_per_step=data[0]["calls_per_step"],
        wrapped_per_step=data[0]["wrapped_per_step"],
        blocks=blocks,
        per_block=per_block,
        busy_us=busy_us,
        seconds=seconds,
    )


WHERE_STEPS = """
import gc
import json
import time
import pytest
import torch
import torch.distributed as dist
from pytest_ddphooks.recorder import active, distpatch

@pytest.mark.multirank(world_size=2, timeout=900)
def test_where(rank, recorder):
@FSDP_MODEL@
    gc_seconds = [0.0]
    gc_started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_started[0]

    gc.callbacks.append(on_gc)

    def steps(n, heartbeat):
        gc_seconds[0] = 0.0
        cpu, own = time.process_time(), time.thread_time()
        for _ in range(n):
            if heartbeat:
                recorder.mark("step")  # progress for the watchdog while nothing is recorded
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return (time.process_time() - cpu) / n, (time.thread_time() - own) / n, gc_seconds[0] / n

    log = active.suspended()
    steps({warmup}, True)
    off = steps({steps}, True)

    clock = time.perf_counter
    spans = {{}}

    def timed(label, fn):
        sink = spans.setdefault(label, [])

        def timed_call(*args, **kwargs):
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(clock() - started)

        return timed_call

    # what FSDP2 calls: the recorder's wrappers of distributed_c10d's functions
    for name in ("all_gather_single", "reduce_scatter_single"):
        setattr(dist, name, timed("outer", getattr(dist, name)))
    run_recorded = distpatch.run_recorded

    def timed_run_recorded(rec, kind, name, call, fn, args, kwargs, after=None):
        after = None if after is None else timed("after", after)
        return run_recorded(rec, kind, name, call, timed("collective", fn), args, kwargs, after)

    distpatch.run_recorded = timed_run_recorded
    distpatch.describe_safely = timed("describe", distpatch.describe_safely)
    distpatch._counter = timed("counter", distpatch._counter)
    for method in ("begin", "end", "counted"):
        setattr(recorder, method, timed(method, getattr(recorder, method)))
    recorder._file.write = timed("write", recorder._file.write)
    recorder._file.write_compact = timed("write", recorder._file.write_compact)
    active.resume(log)
    on = steps({steps}, False)
    spans["own"] = [a - b for a, b in zip(spans["outer"], spans["collective"])]
    out = {{
        "steps": {steps},
        "off": off,
        "on": on,
        "spans": {{k: [len(v), sorted(v)[len(v) // 2] if v else 0.0, sum(v)] for k, v in spans.items()}},
    }}
    print(f"WHERE {{rank}} {{json.dumps(out, separators=(',', ':'))}}")
"""
WHERE_STEPS = WHERE_STEPS.replace("@FSDP_MODEL@\n", FSDP_MODEL)

# the spans WHERE_STEPS times, in the order shown
WHERE_SPANS = {
    "own": "the recorder's own time in a recorded call (the wrapper, less the collective inside it)",
    "describe": "describe_safely: the call's start info (group, counter, seq, payload)",
    "begin": "rec.begin: the start event (lane, time, event file)",
    "counted": "rec.counted: the group's counter after the call",
    "after": "after(): what the call's return tells",
    "end": "rec.end: the end event (time, event file)",
    "write": "event file write (compact, or marshal for an info that is not the call's usual), inside begin / end",
    "counter": "_counter: pg._get_sequence_number_for_group(), inside describe / run_recorded",
    "collective": "the collective itself, inside run_recorded (for scale)",
}


def where_the_time_goes(steps: int, warmup: int = 20) -> list[dict[str, Any]]:
    """Per rank: CPU per step unrecorded and recorded, GC time per step, and the spans of the
    recorder's wrappers (calls, median, total seconds) over ``steps`` recorded FSDP2 steps."""
    rows = _inner_session(WHERE_STEPS.format(steps=steps, warmup=warmup), "WHERE", 2)
    return [json.loads(r[1]) for r in sorted(rows, key=lambda r: int(r[0]))]


FIT_IN_TEST = """
import json
import threading
import time
import pytest
from pytest_ddphooks.recorder import active
from reference_trainer import RegressionDataModule, RegressionModule, Trainer

@pytest.mark.multirank(world_size=2, timeout=1800)
def test_fit(rank, recorder, shared_tmp_path):
    log = active.suspended()
    stop = threading.Event()

    def heartbeat():
        # progress for the watchdog in an unrecorded fit as in a recorded one: a rank that
        # records nothing for 0.5 s is asked for torch's flight recorder (20-190 ms of CPU an ask)
        while not stop.wait(0.1):
            recorder.mark("heartbeat")

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()

    def fit(recorded, name):
        # recorded: the fit instruments into this test's recorder (its hooks, barriers,
        # model_to_device, wrap_model; every torch.distributed call), as Trainer(recorder=...)
        trainer = Trainer("fsdp", max_epochs={epochs}, batch_size={batch}, recorder=recorder if recorded else None)
        module, dm = RegressionModule(), RegressionDataModule(shared_tmp_path / name)
        if recorded:
            active.resume(log)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            result = trainer.fit(module, dm)
        finally:
            took = [time.perf_counter() - wall, time.process_time() - cpu]
            active.suspended()
        assert result.final_loss < result.initial_loss
        return took, len(result.losses)

    fit(False, "warm")
    fits = {{"no": [], "yes": []}}
    steps = 0
    for r in range({rounds}):
        for recorded in (False, True) if r % 2 == 0 else (True, False):
            took, steps = fit(recorded, f"r{{r}}{{recorded}}")
            fits["yes" if recorded else "no"].append(took)
    stop.set()
    beat.join()
    active.resume(log)
    wall, cpu = time.perf_counter(), time.process_time()
    events = len(recorder.timeline().events)
    timeline = [time.perf_counter() - wall, time.process_time() - cpu]
    out = {{"fits": fits, "steps": steps, "timeline": timeline, "events": events}}
    print(f"FIT {{rank}} {{json.dumps(out, separators=(',', ':'))}}")
"""


@dataclass
class FitInTest:
    """Recorded FSDP2 fits of the reference trainer inside a multirank test against unrecorded ones."""

    cpu: list[float]  # per rank: median over rounds of recorded / unrecorded fit CPU, less 1
    wall: list[float]  # the same, wall
    cpu_s: tuple[float, float]  # the worse rank's median fit CPU seconds: unrecorded, recorded
    wall_s: tuple[float, float]  # the slower rank's median fit wall seconds: unrecorded, recorded
    steps: int  # training steps per rank per fit
    rounds: int
    timeline_s: float  # recorder.timeline() at the end, wall, slowest rank
    events: int  # events in that timeline (every recorded fit's, both ranks, heartbeats too)


def fit_in_test(rounds: int, epochs: int, batch: int) -> FitInTest:
    rows = _inner_session(FIT_IN_TEST.format(rounds=rounds, epochs=epochs, batch=batch), "FIT", 2)
    data = [json.loads(r[1]) for r in sorted(rows, key=lambda r: int(r[0]))]

    def paired(d: dict[str, Any], i: int) -> float:
        return median(y[i] / n[i] - 1 for n, y in zip(d["fits"]["no"], d["fits"]["yes"], strict=True))

    def seconds(i: int) -> tuple[float, float]:
        worse = max(data, key=lambda d: paired(d, i))
        return median(f[i] for f in worse["fits"]["no"]), median(f[i] for f in worse["fits"]["yes"])

    return FitInTest(
        cpu=[paired(d, 1) for d in data],
        wall=[paired(d, 0) for d in data],
        cpu_s=seconds(1),
        wall_s=seconds(0),
        steps=data[0]["steps"],
        rounds=rounds,
        timeline_s=max(d["timeline"][0] for d in data),
        events=data[0]["events"],
    )


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=5)
    args = p.parse_args()
    repeats = repeats_of(args)
    report = Report("bench_recorder", "Recorder: cost per event, merge, and a recorded fit", args)
    n = 20_000 if args.quick else 200_000
    progress("per call")
    calls = per_call_seconds(n)
    progress("torch.distributed calls")
    dist_calls = dist_call_seconds(500 if args.quick else 2000)
    collective_event = dist_calls.pop(CPU_ADDED) / 2  # a real collective recorded: per event (start, end)
    bare = calls["bare call"]
    rows = [[k, us(v), us(max(v - bare, 0.0))] for k, v in calls.items()]
    for k, v in dist_calls.items():
        if k.startswith("no-op"):
            base = "no-op in the all_reduce wrapper, no recorder"
        else:
            base = CPU_UNRECORDED if k.endswith("calling thread") else "all_reduce (unpatched)"
        rows.append([k, us(v), us(max(v - dist_calls[base], 0.0))])
    # the recorder's own work per recorded collective, in a hot loop (no collective in it)
    own_hot = max(
        dist_calls["no-op in the all_reduce wrapper, recorded to file"]
        - dist_calls["no-op in the all_reduce wrapper, no recorder"],
        1e-6,
    )
    event_cost = calls["mark (event file)"]
    call_cost = (calls["instrumented call (event file)"] - bare) / 2  # two events per call
    report.section(
        "Per event and per call (best of 3 x N calls)",
        table(["what", "per call", "added over the bare call"], rows)
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [
                ["one recorded event (to the event file) under 5 us", us(event_cost), verdict(event_cost < 5e-6)],
                ["instrumented call, per event, under 5 us", us(call_cost), verdict(call_cost < 5e-6)],
                [
                    "recorded all_reduce, CPU of the calling thread added per event (two events a call; median of"
                    f" {PAIRED_ROUNDS} paired rounds), under 5 us",
                    us(collective_event),
                    verdict(collective_event < 5e-6),
                ],
            ],
        ),
        [
            "An instrumented call records two events (start, end). 'event file' is what a rank does: each"
            " event is also written to its memory-mapped, crash-safe file. The torch.distributed rows use a"
            " world-size-1 gloo group (all_reduce of 4 floats); on a world-size-1 group the collective's own"
            " time swings with when gloo's worker thread runs, so the recorded all_reduce's added time is"
            " noisy. The no-op rows time the recorder's all_reduce wrapper around a function that does"
            " nothing: the recorder's own work per recorded collective (describe it, two events to the"
            " file, the group's counter read twice), in a hot loop; the row 'over N calls in a row' runs it"
            " 100 times as long without taking the best, so that the garbage collector's work over what"
            " the recorder keeps is in it. The 'CPU of the calling thread' rows"
            " time the real collective by the thread's own CPU clock, which the scheduling of gloo's"
            " threads does not move: what recording a real collective costs the thread that issues it,"
            " with the collective's own work between two of its calls (the caches it leaves behind). They"
            f" are medians of {PAIRED_ROUNDS} rounds of N unrecorded calls (recording suspended) then N"
            " recorded ones, and the target row is the median of each round's difference. Python code"
            " right after a collective's wait runs 2 to 3 times slower here than in a hot loop (measured"
            " with plain arithmetic in the same place), and the recorder's code is in that place.",
        ],
    )
    progress("timeline of 8 ranks x 10,000 events")
    ranks, per_rank = (8, 2_000) if args.quick else (8, 10_000)
    merge = timeline_seconds(ranks, per_rank)
    report.section(
        f"Timeline of {ranks} ranks x {per_rank:,} events (a collective every 10 events; best of 3)",
        table(["step", "seconds"], [[k, f"{v:.3f}"] for k, v in merge.items()])
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [["merge + clocks under 1 s", f"{merge['merge+clocks']:.3f} s", verdict(merge["merge+clocks"] < 1.0)]],
        ),
    )
    progress("timeline() of 1,000,000 events across 8 ranks")
    big_ranks, big_per_rank = (8, 12_500) if args.quick else (8, 125_000)
    events_total, big_seconds, big_rss = large_timeline(big_ranks, big_per_rank)
    report.section(
        f"recorder.timeline() of {events_total:,} events across {big_ranks} ranks (a multirank test)",
        table(
            ["figure", "measured"],
            [
                ["events in the merged timeline", f"{events_total:,}"],
                ["timeline() on the slowest rank (every rank builds the whole timeline)", f"{big_seconds:.1f} s"],
                ["largest max RSS of a rank", f"{big_rss} MiB"],
            ],
        ),
        [
            "Each rank's events travel through the run's store compressed and in chunks under its 8 MiB"
            " payload limit; the 8 ranks share this machine's 2 cores while each builds the whole timeline.",
        ],
    )
    fsdp_blocks, fsdp_per_block = (12, 10) if args.quick else (100, 25)
    busy_us = own_hot * 1e6
    fsdp_runs = []
    for i in range(2):
        progress(f"FSDP2 steps, recorded / not / busy-work control, alternating inside the ranks: run {i + 1}/2")
        fsdp_runs.append(fsdp_step_overhead(fsdp_blocks, fsdp_per_block, busy_us))
    first = fsdp_runs[0]
    wrapped = f"{first.wrapped_per_step:.0f}"

    def each(fn: Any) -> list[str]:
        return [fn(r) for r in fsdp_runs]

    fsdp_rows = [
        ["process CPU per step, recorded / not", *each(lambda r: r.recorded["process CPU"].cell())],
        ["main-thread CPU per step, recorded / not", *each(lambda r: r.recorded["main-thread CPU"].cell())],
        ["wall per step, recorded / not", *each(lambda r: r.recorded["wall"].cell())],
        [
            "CPU the recording added per step: process / main thread",
            *each(lambda r: f"{r.added_us('process CPU'):.0f} µs / {r.added_us('main-thread CPU'):.0f} µs"),
        ],
        [
            "main-thread CPU added per recorded call",
            *each(lambda r: f"{r.added_us('main-thread CPU') / r.calls_per_step:.0f} µs"),
        ],
        [
            f"control, process CPU: {busy_us:.0f} µs busy work before each of the {wrapped} all-gathers and"
            " reduce-scatters of a step instead of recording, / not (the busy work's own share)",
            *each(lambda r: f"{r.control['process CPU'].cell()} ({r.control_expected('process CPU') * 100:+.1f}%)"),
        ],
        [
            "control, main-thread CPU (the busy work's own share)",
            *each(
                lambda r: f"{r.control['main-thread CPU'].cell()} ({r.control_expected('main-thread CPU') * 100:+.1f}%)"
            ),
        ],
        ["control, wall", *each(lambda r: r.control["wall"].cell())],
        [
            "an unrecorded step: process CPU / main-thread CPU / wall",
            *each(lambda r: " / ".join(ms(r.unrecorded[c]) for c in ("process CPU", "main-thread CPU", "wall"))),
        ],
        ["recorded calls per step (two events each)", *each(lambda r: f"{r.calls_per_step:.1f}")],
        ["inner session wall", *each(lambda r: f"{r.seconds:.0f} s")],
    ]
    fsdp_cpu = [r.recorded["process CPU"].worse for r in fsdp_runs]
    report.section(
        "FSDP2 training steps (fully_shard, 2 ranks): recorded against not, inside the same ranks",
        table(["figure", "run 1", "run 2"], fsdp_rows)
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [
                [
                    "recording FSDP2 steps costs under 5% more CPU (process CPU, the worse rank's median, each run)",
                    " / ".join(f"{v * 100:+.1f}%" for v in fsdp_cpu),
                    verdict(all(v < 0.05 for v in fsdp_cpu)),
                ]
            ],
        ),
        [
            f"Each run: {first.blocks} blocks of three modes, {first.per_block} steps each (recorded; not"
            " recorded; not recorded with busy work before each all-gather and reduce-scatter), the order of"
            " the modes rotating from block to block; every rank switches at the same step, so launching"
            " ranks and warm-up are outside the measurement. A figure is, per rank, the median over blocks"
            " of the block's per-step time over its unrecorded block's; the table shows the worse rank's"
            " with a 95% confidence interval of that median, then each rank's.",
            "The target is judged on process CPU (time.process_time() in the rank: every thread of the"
            " process, gloo's included): the recorder's cost is CPU work in the rank. Wall time on this"
            " 2-core machine, both ranks busy and other jobs running, mostly measures when the peer rank is"
            " scheduled; it and the control are information. Main-thread CPU (time.thread_time()) is"
            " where FSDP2 issues, and the recorder records, every collective; gloo's threads add 2 to 3 ms"
            " of CPU per step that varies with how long a rank waits for its peer, which makes process CPU"
            " the noisier figure.",
            f"The control spins {busy_us:.0f} µs (the recorder's own work per recorded call in a hot loop,"
            " the no-op rows above) before each all-gather and reduce-scatter: it checks that the CPU"
            " clocks see a known amount of added work (in brackets: what the spinning itself adds).",
            "Every step of every mode records one mark, so the watchdog sees progress in the unrecorded"
            " blocks too: a rank that records nothing for 0.5 s is asked to read torch's flight recorder,"
            " which costs it 20 ms of CPU (a dump of its 2,000 entries) to 190 ms (2,000 entries it had"
            " not seen, turned into events) a time, and would land in the unrecorded blocks.",
        ],
    )
    progress("where the recorder's time goes in a recorded FSDP2 step")
    where_steps = 50 if args.quick else 300
    where = where_the_time_goes(where_steps)

    def per_rank(fn: Any) -> str:
        return " / ".join(fn(d) for d in where)

    where_rows = []
    for key, label in WHERE_SPANS.items():
        if any(key not in d["spans"] for d in where):
            continue  # a span that never ran (a collective's return tells nothing more: no after())
        where_rows.append(
            [
                label,
                f"{where[0]['spans'][key][0] / where_steps:.0f}",
                per_rank(lambda d, key=key: f"{d['spans'][key][1] * 1e6:.1f} µs"),
                per_rank(lambda d, key=key: f"{d['spans'][key][2] / where_steps * 1e6:.0f} µs"),
            ]
        )
    where_rows += [
        [
            "main-thread CPU per step: unrecorded, then recorded with these timers",
            "",
            "",
            per_rank(lambda d: f"{d['off'][1] * 1e6:.0f} → {d['on'][1] * 1e6:.0f} µs"),
        ],
        [
            "process CPU per step: unrecorded, then recorded with these timers",
            "",
            "",
            per_rank(lambda d: f"{d['off'][0] * 1e6:.0f} → {d['on'][0] * 1e6:.0f} µs"),
        ],
        [
            "garbage collection per step: unrecorded, then recorded",
            "",
            "",
            per_rank(lambda d: f"{d['off'][2] * 1e6:.0f} → {d['on'][2] * 1e6:.0f} µs"),
        ],
    ]
    own_median = max(d["spans"]["own"][1] for d in where)
    report.section(
        f"Where the recorder's time goes in a recorded FSDP2 step ({where_steps} steps, 2 ranks)",
        table(["span", "calls per step", "median per call (rank 0 / 1)", "per step (rank 0 / 1)"], where_rows),
        [
            "Each span is timed with time.perf_counter() around the recorder's wrappers in the rank (the"
            " all_gather_single / reduce_scatter_single wrappers FSDP2 calls; distpatch.run_recorded,"
            " describe_safely, _counter; the recorder's begin, end, counted and its event file's write),"
            " the package untouched. Medians per call ignore the calls during which the rank was"
            " descheduled; 'per step' is the total over the steps, divided by them. Spans nest (the event"
            " file writes are inside begin and end), and every timer adds a little of its own.",
            f"In a step the recorder's own work takes about {own_median * 1e6:.0f} µs per recorded call, against"
            f" {busy_us:.0f} µs for the same wrapper in a hot loop (the no-op rows above): between two"
            " collectives FSDP2 runs far more code than fits in the caches, so the recorder's code and"
            " data are cold at every call.",
        ],
    )
    progress("reference-trainer FSDP2 fits inside a multirank test, recorded and not")
    in_rounds, in_epochs = (1, 3) if args.quick else (7, 25)
    in_test = fit_in_test(in_rounds, in_epochs, 16)
    report.section(
        f"A reference-trainer FSDP2 fit inside a multirank test (2 ranks, {in_test.steps} steps per rank):"
        f" recorded vs not (median of {in_test.rounds} rounds, alternating)",
        table(
            ["figure", "not recorded", "recorded", "recorded / not (rank 0 / 1)"],
            [
                [
                    "fit, process CPU of a rank",
                    f"{in_test.cpu_s[0]:.2f} s",
                    f"{in_test.cpu_s[1]:.2f} s",
                    " / ".join(f"{v * 100:+.1f}%" for v in in_test.cpu),
                ],
                [
                    "fit, wall",
                    f"{in_test.wall_s[0]:.2f} s",
                    f"{in_test.wall_s[1]:.2f} s",
                    " / ".join(f"{v * 100:+.1f}%" for v in in_test.wall),
                ],
                [
                    f"recorder.timeline() once at the end ({in_test.events:,} events, every recorded fit's)",
                    "",
                    f"{in_test.timeline_s:.2f} s",
                    "",
                ],
            ],
        ),
        [
            "Each rank runs Trainer('fsdp', recorder=recorder) (the test's recorder: every hook, the"
            " strategy's barriers, model_to_device, wrap_model, every torch.distributed call, to the rank's"
            " event file) and, alternating with it, the same fit with recording suspended"
            " (pytest_ddphooks.recorder.active.suspended()) and no recorder given; the process group is the"
            " test's. CPU is time.process_time() of the rank around trainer.fit(); the ratio is the median"
            " over rounds of recorded over unrecorded. A thread marks the recorder every 0.1 s in both"
            " modes, so the watchdog never asks an unrecorded rank for torch's flight recorder.",
        ],
    )
    epochs, batch = (5, 16) if args.quick else (25, 16)
    fits = []
    overheads: dict[str, float] = {}
    cases = [("single", "hooks", 16), ("single", "steps", 16), ("ddp", "hooks", 8), ("fsdp", "hooks", 8)]
    with tempfile.TemporaryDirectory() as d:
        for strategy, record, steps_per_epoch in cases:
            times: dict[str, list[tuple[float, float]]] = {"no": [], record: []}
            fit_seconds(strategy, "no", 1, batch, os.path.join(d, "warm"))  # warm-up
            for r in range(repeats):
                for mode in ("no", record) if r % 2 == 0 else (record, "no"):
                    progress(f"fit {strategy}, round {r + 1}/{repeats}, record={mode}")
                    path = os.path.join(d, f"{strategy}{record}{r}{mode}")
                    times[mode].append(fit_seconds(strategy, mode, epochs, batch, path))
            plain, recorded = median(t[0] for t in times["no"]), median(t[0] for t in times[record])
            plain_cpu, recorded_cpu = median(t[1] for t in times["no"]), median(t[1] for t in times[record])
            overheads[f"{strategy}/{record}"] = recorded / plain - 1
            fits.append(
                [
                    strategy,
                    record,
                    epochs * steps_per_epoch,
                    repeats,
                    f"{ms(plain)} / {ms(plain_cpu)}",
                    f"{ms(recorded)} / {ms(recorded_cpu)}",
                    f"{(recorded / plain - 1) * 100:+.1f}%",
                    f"{(recorded_cpu / plain_cpu - 1) * 100:+.1f}%",
                ]
            )
    headline = overheads["single/hooks"] * 100
    target = "recording a fit (what Trainer(record=True) instruments) under 3%"
    report.section(
        f"A reference-trainer fit: {epochs} epochs, recorded vs not (median of {repeats}, rounds interleaved,"
        " the order swapped every round)",
        table(
            [
                "strategy",
                "recorded",
                "steps per rank",
                "repeats",
                "not recorded (wall / CPU)",
                "recorded (wall / CPU)",
                "overhead, wall",
                "overhead, CPU",
            ],
            fits,
        )
        + "\n\n"
        + table(
            ["target", "value", "met"],
            [[target, f"{headline:+.1f}%", verdict(headline < 3.0)]],
        ),
        [
            "hooks: what Trainer(record=True) instruments (every hook, the strategy's barriers,"
            " model_to_device, wrap_model; torch.distributed calls), the timeline built at the end. steps:"
            " also every training_step, two events per step: on this tiny model a step takes about 0.2 ms,"
            " so a few microseconds per step are a visible share. ddp: the trainer launches 2 ranks, each"
            " records to its event file and the parent merges the timeline; the wall includes launching the"
            " ranks, whose run-to-run noise (tens of ms) is larger than the recording. fsdp: the same with"
            " FSDP2 fully_shard, whose every step records its all-gathers and reduce-scatters.",
            "CPU: user + system time of this process and of the ranks it launched (getrusage of itself and"
            " of its waited-for children around the fit); medians of wall and of CPU are taken separately.",
        ],
    )
    report.write()


if __name__ == "__main__":
    main()
