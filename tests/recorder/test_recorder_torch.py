"""Real torch.distributed calls recorded in one process, on a world-size-1 gloo group."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_ddphooks.recorder import Recorder, core, distpatch, events, native
from pytest_ddphooks.recorder.events import read_raw
from pytest_ddphooks.recorder.log import counting

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A world-size-1 gloo group, always destroyed (the leak guard fails a test leaving one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def calls(rec: Recorder, phase: str = events.START) -> list[tuple[str, dict[str, Any]]]:
    return [
        (e.name, dict(e.info))
        for e in rec.events
        if e.kind in (events.COLLECTIVE, events.P2P, events.GROUP) and e.phase == phase
    ]


def test_torch_distributed_is_patched() -> None:
    assert distpatch.installed()
    assert hasattr(dist.barrier, "__ddphooks_original__")
    assert dist.barrier is dist.distributed_c10d.barrier


def test_install_walks_a_module_once_and_a_new_module_object_again(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[Any] = []
    monkeypatch.setitem(distpatch._PATCHERS, distpatch._C10D, walked.append)
    monkeypatch.setattr(distpatch, "_patched", dict(distpatch._patched))
    distpatch.install()  # every rank's recorder activates: the patched module is left alone
    assert walked == []
    fresh = type(dist.distributed_c10d)(distpatch._C10D)  # as if the module were imported again
    monkeypatch.setitem(sys.modules, distpatch._C10D, fresh)
    distpatch.install()
    distpatch.install()
    assert walked == [fresh]


def record_calls(tmp_path: Path) -> tuple[Recorder, list[Any]]:
    """Run the calls; the group objects die with this frame, so a failing assertion in the
    test cannot keep gloo's sockets open (which the leak guard would report too)."""
    with Recorder(rank=0, world_size=1) as rec:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        try:
            t = torch.ones(4)
            dist.barrier()
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            objects: list[Any] = [{"a": 1}, torch.ones(2)]
            dist.broadcast_object_list(objects)  # src defaults to 0; broadcasts twice inside
            gathered: list[Any] = [None]
            dist.all_gather_object(gathered, {"rank": 0})
            sub = dist.new_group([0])
            dist.all_reduce(torch.ones(2, 3, dtype=torch.float64), op=dist.ReduceOp.MAX, group=sub)
            dist.broadcast(t, group_src=0, group=sub)
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            del sub, work
        finally:
            dist.destroy_process_group()
    return rec, gathered


def test_collectives_are_recorded_with_their_arguments(tmp_path: Path) -> None:
    rec, gathered = record_calls(tmp_path)
    started = calls(rec)
    assert [name for name, _ in started] == [
        "dist.init_process_group",
        "dist.barrier",
        "dist.all_reduce",
        "dist.broadcast",
        "dist.broadcast_object_list",
        "dist.all_gather_object",
        "dist.new_group",
        "dist.all_reduce",
        "dist.broadcast",
        "dist.all_reduce",
        "dist.destroy_process_group",
    ]
    info = [i for _, i in started]
    assert info[0] == {"op": "init_process_group", "group_existed": False, "backend": "gloo"}
    common = {"group_existed": True, "group": "default", "group_size": 1}
    assert info[1] == {"op": "barrier", **common, "seq": 1}
    assert info[2] == {"op": "all_reduce", **common, "seq": 2, "payload": "float32[4]", "reduce_op": "SUM"}
    assert info[3] == {"op": "broadcast", **common, "seq": 3, "payload": "float32[4]", "root": 0}
    assert info[4] == {"op": "broadcast_object_list", **common, "seq": 4, "payload": "objects x2", "root": 0}
    # numbered by the group's own sequence: broadcast_object_list broadcast twice (sizes, data)
    assert info[5] == {"op": "all_gather_object", **common, "seq": 6, "payload": "object"}
    assert info[6] == {"op": "new_group", "group_existed": True, "ranks": [0]}
    sub_name = calls(rec, events.END)[6][1]["group"]
    assert info[7] == {
        "op": "all_reduce",
        "group_existed": True,
        "group": sub_name,
        "ranks": [0],
        "seq": 1,
        "payload": "float64[2,3]",
        "reduce_op": "MAX",
    }
    assert info[8]["group"] == sub_name and info[8]["seq"] == 2 and info[8]["root"] == 0
    assert info[9] == {
        "op": "all_reduce",
        **common,
        "async": True,
        "seq": 8,
        "payload": "float32[4]",
        "reduce_op": "SUM",
    }
    assert info[10]["op"] == "destroy_process_group"
    ended = calls(rec, events.END)
    assert ended[0][1] == {"rank": 0, "world_size": 1}
    assert ended[9][1] == {"async": True}
    # the objects arrived intact, and the nested broadcasts were not recorded
    assert gathered == [{"rank": 0}]
    assert sum(1 for name, _ in started if name == "dist.broadcast") == 2
    # the merged timeline agrees with itself
    tl = rec.timeline()
    assert tl.collective_mismatches() == []
    assert {k for k in tl.instances if k[0] == "c"} == {("c", "default", s) for s in (1, 2, 3, 4, 6, 8)} | {
        ("c", sub_name, 1),
        ("c", sub_name, 2),
    }
    assert all(inst.complete and inst.consistent for inst in tl.instances.values())


def test_a_reduce_op_object_is_named_like_the_enum(group: None) -> None:
    with Recorder(0, 1) as rec:
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp(dist.ReduceOp.MIN))
    assert calls(rec)[0][1]["reduce_op"] == "MIN"


def test_uneven_all_to_all_single_is_described_by_its_input(group: None) -> None:
    with Recorder(0, 1) as rec:
        dist.all_to_all_single(torch.zeros(3), torch.ones(3))
    assert calls(rec)[0][1]["payload"] == "float32[3]"


def test_a_collective_without_a_group_is_recorded_as_not_effective() -> None:
    assert not dist.is_initialized()
    issued = [0]  # what a framework barrier around it would count
    with Recorder(0, 1) as rec, counting(issued), pytest.raises((ValueError, RuntimeError)):
        dist.barrier()
    (start,) = calls(rec)
    assert start[1] == {"op": "barrier", "group_existed": False, "effective": False}
    (end,) = calls(rec, events.END)
    assert "error" in end[1]
    assert issued == [0]


def test_nothing_is_recorded_outside_a_recorder(group: None) -> None:
    rec = Recorder(0, 1)
    dist.barrier()
    with rec:
        dist.barrier()
    dist.barrier()
    # one call recorded, numbered by the group's own sequence (which counted the first too)
    assert [i["seq"] for _, i in calls(rec)] == [2]
    assert core.current() is None


def test_a_call_the_recorder_cannot_describe_still_runs(group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(value: Any) -> str:
        raise RuntimeError("cannot describe")

    monkeypatch.setattr(distpatch, "describe_tensor", broken)
    t = torch.ones(2)
    with Recorder(0, 1) as rec:
        dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    assert calls(rec)[0][1] == {"op": "all_reduce", "recorder_error": "RuntimeError: cannot describe"}


def test_an_async_call_whose_return_the_recorder_cannot_read_still_completes_at_its_wait(
    group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("cannot count")

    t = torch.ones(2)
    with Recorder(0, 1) as rec:
        monkeypatch.setattr(rec, "counted", broken)
        work = dist.all_reduce(t, async_op=True)
        (end,) = calls(rec, events.END)
        # still asynchronous: its return completes nothing, and it is not waited yet
        assert end[1] == {"async": True, "recorder_error": "RuntimeError: cannot count"}
        assert [name for _, name, _ in rec.never_waited()] == ["dist.all_reduce"]
        work.wait()
        assert rec.never_waited() == []
        assert [e.name for e in rec.events if e.kind == events.WAIT] == ["dist.all_reduce.wait"] * 2
    assert t.tolist() == [1.0, 1.0]


def test_marks_named_anew_each_time_add_no_templates(tmp_path: Path) -> None:
    path = tmp_path / "events"
    with Recorder(0, 1, event_file=str(path)) as rec:
        for i in range(100):
            rec.mark(f"step {i}")
        assert rec._file is not None and rec._file._templates == {}
        assert [r[5] for r in read_raw(path) if r[3] == events.MARK] == [f"step {i}" for i in range(100)]


def test_the_flight_recorder_is_read_only_when_a_call_went_unseen(group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    dumps: list[int] = []
    real_dump = native._dump
    monkeypatch.setattr(native, "_dump", lambda: dumps.append(1) or real_dump())
    t = torch.ones(1)

    def as_native_code_calls_it() -> None:
        dist.ProcessGroup.allreduce.__ddphooks_original__(dist.group.WORLD, [t]).wait()

    def natives(rec: Recorder) -> list[Any]:
        tl = rec.timeline()
        return [e.info.get("native") for e in tl.for_rank(0) if e.kind == events.COLLECTIVE and e.phase == events.START]

    with Recorder(0, 1) as rec:
        dist.all_reduce(t)
        assert natives(rec) == [None]
        assert natives(rec) == [None]
        assert dumps == []  # every collective recorded: nothing in it to read
        as_native_code_calls_it()  # after the last recorded call
        assert natives(rec)[1] is not None
        assert len(dumps) == 1
        natives(rec)
        assert len(dumps) == 1  # read once
        as_native_code_calls_it()
        dist.all_reduce(t)  # a gap between two recorded calls
        assert [n is not None for n in natives(rec)] == [False, True, True, False]
        assert len(dumps) == 2


@pytest.mark.parametrize(
    ("then", "late_for"), [("recorded", 1), ("recorded", 99), ("native", 99)], ids=["in-a-gap", "never", "out-of-order"]
)
def test_a_flight_recorder_entry_written_late_is_read_when_it_appears(
    group: None, monkeypatch: pytest.MonkeyPatch, then: str, late_for: int
) -> None:
    # another thread's call on the group: its counter moved at once, its entry comes later
    # (and so takes a later record id than the entries written meanwhile); ``late_for``: dumps
    # it is missing from
    not_yet: set[int] = set()
    written_late: set[int] = set()
    dumps = [0]
    real_dump = native._dump

    def dump() -> list[dict[str, Any]]:
        dumps[0] += 1
        hidden = not_yet if dumps[0] <= late_for else set()
        entries = [dict(e) for e in real_dump() if int(e["op_id"]) not in hidden]
        for e in entries:
            if int(e["op_id"]) in written_late | (not_yet - hidden):
                e["record_id"] = 10**9
        return entries

    monkeypatch.setattr(native, "_dump", dump)
    monkeypatch.setattr(core, "_ENTRY_GRACE_S", 0.0)
    t = torch.ones(1)

    def as_native_code_calls_it() -> None:
        dist.ProcessGroup.allreduce.__ddphooks_original__(dist.group.WORLD, [t]).wait()

    def native_seqs(rec: Recorder) -> list[int]:
        tl = rec.timeline()
        return sorted(e.info.get("seq", 0) for e in tl.for_rank(0) if e.phase == events.START and e.info.get("native"))

    with Recorder(0, 1) as rec:
        dist.all_reduce(t)  # 1
        not_yet.add(2)
        as_native_code_calls_it()  # 2
        if then == "recorded":
            dist.all_reduce(t)  # 3: finds the gap where 2 is
        else:
            as_native_code_calls_it()  # 3, its entry written before 2's
        if late_for == 1:  # there at the second look: read, and the numbering holds
            assert native_seqs(rec) == [2]
            recorded = [e for e in rec.events if e.name == "dist.all_reduce" and e.phase == "start"]
            assert [e.info.get("seq") for e in recorded if not e.info.get("native")] == [1, 3]
            return
        assert native_seqs(rec) == ([] if then == "recorded" else [3])
        if then == "recorded":
            # missing at both looks: for all anyone knows a send, which moved this rank's count
            # alone: the calls after it have no number
            third = [e for e in rec.timeline().for_rank(0) if e.name == "dist.all_reduce" and e.phase == "start"][1]
            assert "seq" not in third.info and "flight recorder saw" in third.info["unsure"]
            return
        not_yet.clear()
        written_late.add(2)
        assert native_seqs(rec) == [2, 3]


def test_instrument_barrier_counts_collectives_and_knows_if_a_group_existed(tmp_path: Path) -> None:
    class Trainer:
        def real_barrier(self) -> None:
            dist.barrier()

        def fake_barrier(self) -> None:
            pass

    trainer = Trainer()
    with Recorder(0, 1) as rec:
        rec.instrument_barrier(trainer, "real_barrier")
        rec.instrument_barrier(trainer, "fake_barrier", as_name="sync")
        trainer.fake_barrier()  # no group yet
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        try:
            trainer.real_barrier()
            trainer.fake_barrier()
        finally:
            dist.destroy_process_group()
    spans = [s for s in rec.timeline().spans() if s.kind == events.BARRIER]
    assert [(s.name, s.start.info["group_existed"], s.end.info["collectives"]) for s in spans] == [
        ("sync", False, 0),
        ("real_barrier", True, 1),
        ("sync", True, 0),
    ]
    assert spans[0].start.info["qualname"].endswith("Trainer.fake_barrier")
    reasons = [nb.reason for nb in rec.timeline().noop_barriers()]
    assert reasons == [
        "issued no collective: no process group existed",
        "issued no collective: the process group existed but no collective was called",
    ]


STANDALONE = """
import os, sys
import torch.distributed as dist
import torch.multiprocessing as mp
from pytest_ddphooks import Recorder

def work(rank, store, early):
    if early:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    with Recorder() as rec:  # no RANK in the environment: the group tells
        if not early:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        dist.barrier()
        tl = rec.timeline()
    own = len(tl.for_rank(rank)) > 0
    os.write(1, f"rank {rank}: ranks={tl.ranks} world={rec.world_size} own={own}\\n".encode())  # one write
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(work, args=(sys.argv[1], sys.argv[2] == "early"), nprocs=2, start_method="fork")
"""


@pytest.mark.parametrize("when", ["early", "late"])
def test_a_standalone_recorder_takes_its_rank_from_the_group(tmp_path: Path, when: str) -> None:
    import os
    import subprocess

    script = tmp_path / "standalone.py"
    script.write_text(STANDALONE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), when],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: ranks=[0] world=2 own=True", "rank 1: ranks=[1] world=2 own=True"]


BEFORE_TORCH = """
import sys, tempfile
from pytest_ddphooks import Recorder
assert "torch" not in sys.modules
with Recorder(rank=0, world_size=1) as rec:  # begins before torch is imported
    rec.mark("first")
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
print([e.name for e in rec.timeline().events if e.phase != "end"])
"""


def test_a_recorder_begun_before_torch_is_imported_records_what_torch_then_does(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "before_torch.py"
    script.write_text(BEFORE_TORCH)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == (
        "['first', 'dist.init_process_group', 'dist.all_reduce', 'dist.destroy_process_group']"
    )


def test_a_recorder_told_its_rank_keeps_it(group: None) -> None:
    with Recorder(rank=3, world_size=4) as rec:
        rec.mark("x")
    assert rec.rank == 3 and rec.world_size == 4
    assert Recorder().rank == 0  # the world-size-1 group's


def test_a_warning_inside_a_recorded_call_points_at_the_caller(group: None) -> None:
    import warnings

    funcol = pytest.importorskip("torch.distributed._functional_collectives")

    class Hooks:
        def on_fit(self) -> None:
            warnings.warn("on_fit is deprecated", DeprecationWarning, stacklevel=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(0, 1) as rec:
            rec.instrument(Hooks()).on_fit()
            line = sys._getframe().f_lineno - 1
            funcol.all_gather_tensor(torch.ones(2), 0, dist.group.WORLD).wait()
    sites = {(Path(w.filename).name, w.lineno) for w in caught if "deprecated" in str(w.message)}
    assert sites == {(Path(__file__).name, line), (Path(__file__).name, line + 2)}


def test_a_method_called_by_keyword_is_described_from_its_keywords(group: None) -> None:
    from torch._C._distributed_c10d import ProcessGroup

    signatures = distpatch.overloads(ProcessGroup.broadcast)
    assert ("tensor", "root", "timeout") in signatures
    assert distpatch.positional((), {"tensor": 1, "root": 0}, signatures) == (1, 0)
    assert distpatch.positional(([1],), {}, signatures) == ([1],)
    with pytest.raises(TypeError, match=r"keyword arguments \['nonsense'\] match no overload"):
        distpatch.positional((), {"nonsense": 1}, signatures)
    pg = dist.group.WORLD
    with Recorder(0, 1) as rec:
        pg.allreduce(tensors=[torch.empty(0)]).wait()
        pg.broadcast(tensor=torch.ones(2), root=0).wait()
    starts = [info for name, info in calls(rec) if name == "dist.all_reduce" or name == "dist.broadcast"]
    assert starts[0]["payload"] == "float32[0]" and starts[1]["root"] == 0, starts
