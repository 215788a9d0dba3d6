"""The crash-safe event file: what a killed rank wrote is still there."""

from __future__ import annotations

import gc
import marshal
import os
import signal
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_ddphooks.recorder import Recorder, Timeline, events
from pytest_ddphooks.recorder.events import EventFile, read_raw, to_events, to_events_and_threads


def record(i: int, size: int = 0) -> events.RawEvent:
    return (i, 1_000 + i, 0, events.MARK, events.POINT, f"m{i}", {"i": i, "pad": "x" * size} if size else None)


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize(("count", "size"), [(1000, 0), (3000, 1000)], ids=["small", "beyond-1MiB"])
def test_records_survive_sigkill_without_close(tmp_path: Path, count: int, size: int) -> None:
    path = tmp_path / "events"
    pid = os.fork()
    if pid == 0:  # child: write, then die without closing or flushing anything
        try:
            f = EventFile(path)
            for i in range(count):
                f.write(record(i, size))
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    got = list(read_raw(path))
    assert len(got) == count
    assert got == [record(i, size) for i in range(count)]
    if size:
        assert path.stat().st_size > 1 << 20


def test_growth_beyond_one_mib_in_process(tmp_path: Path) -> None:
    path = tmp_path / "events"
    f = EventFile(path)
    big = (1, 2, 0, events.MARK, events.POINT, "big", {"blob": "y" * (3 << 20)})  # one record over 3 MiB
    f.write(record(0))
    f.write(big)
    f.write(record(2))
    assert list(read_raw(path)) == [record(0), big, record(2)]
    f.close()
    f.close()  # twice is harmless
    assert os.path.getsize(path) % (1 << 20) == 0
    assert list(read_raw(path)) == [record(0), big, record(2)]


def written(tmp_path: Path, n: int = 5) -> tuple[Path, int]:
    """A closed file of n records; returns it and the offset where record n-1 starts."""
    path = tmp_path / "events"
    f = EventFile(path)
    for i in range(n):
        f.write(record(i))
    f.close()
    last = sum(4 + len(marshal.dumps(record(i))) for i in range(n - 1))
    return path, last


def test_a_forked_child_records_nothing_into_its_parents_file_and_says_so(tmp_path: Path) -> None:
    """A DataLoader worker forked from a rank shares the rank's event file: its records would
    land where the rank's next ones go (and an armed fault would act in it)."""
    path = tmp_path / "events"
    rec = Recorder(0, 1, event_file=str(path))
    try:
        rec.mark("before")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            os.dup2(write, 2)
            for i in range(100):
                rec.mark(f"in worker {i}")
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        said = os.read(read, 4096).decode()
        os.close(read)
        rec.mark("after")
        names = [r[5] for r in read_raw(path) if r[3] == events.MARK]
    finally:
        rec.close()
    assert names == ["before", "after"]
    assert [e.name for e in rec.timeline().events] == ["before", "after"]
    assert said == (
        f"ddphooks: 'in worker 0' was recorded in process {pid}, which the recording process (rank 0) forked:"
        " only that process records; what processes it starts record is not in its timeline\n"
    )


def test_a_torn_tail_is_ignored(tmp_path: Path) -> None:
    path, last = written(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(last + 4 + 3)  # the last record lost most of its payload
    assert list(read_raw(path)) == [record(i) for i in range(4)]
    with open(path, "r+b") as f:
        f.truncate(last + 2)  # even its length is half gone
    assert list(read_raw(path)) == [record(i) for i in range(4)]


@pytest.mark.parametrize(
    "tail",
    [
        frame(b"\xff\xfe garbage"),  # not marshal
        struct.pack("<I", 1 << 30) + b"abc",  # a length past the end
        frame(marshal.dumps(42)),  # marshal, but not a record
        frame(marshal.dumps((1, 2, 3))),
        frame(marshal.dumps(("a", 2, 0, "mark", "point", "x", None))),
    ],
    ids=["garbage", "long-length", "int", "short-tuple", "bad-types"],
)
def test_a_corrupt_tail_is_ignored(tmp_path: Path, tail: bytes) -> None:
    path, last = written(tmp_path)
    with open(path, "r+b") as f:
        f.seek(last)
        f.write(tail)
    assert list(read_raw(path)) == [record(i) for i in range(4)]


def test_a_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert list(read_raw(tmp_path / "nothing")) == []


def test_a_recorder_file_holds_what_the_recorder_holds(tmp_path: Path) -> None:
    path = tmp_path / "rank0.events"

    class Hooks:
        def step(self) -> None:
            pass

    rec = Recorder(0, 1, event_file=path)
    h = rec.instrument(Hooks(), "step")
    h.step()
    rec.mark("done", epoch=1)
    raw = list(read_raw(path))  # readable before close, as the orchestrator reads a hung rank
    assert raw == rec.records()
    rec.close()
    assert list(read_raw(path)) == raw
    evs, lanes, idents = to_events_and_threads(0, raw)
    assert [e.name for e in evs] == ["step", "step", "done"]
    assert lanes == {0: rec_main_name()}
    assert set(idents) == {0}
    assert to_events(0, raw)[0] == evs
    tl = Timeline.from_raw({0: raw})
    tl.assert_order(["step", "done"])
    assert [e.index for e in tl.for_rank(0)] == [0, 1, 2]


def rec_main_name() -> str:
    import threading

    return threading.main_thread().name


# -- compact records: the usual start and end of a call, written as a template and 44 bytes --

STATIC = {"op": "all_reduce", "group": "default", "group_size": 2, "payload": "float32[4]"}


def compact_calls(n: int) -> list[events.RawEvent]:
    """n collectives (start: STATIC plus its seq; end: no info) and their waits (two numbers)."""
    out: list[events.RawEvent] = []
    for i in range(1, n + 1):
        out.append((3 * i, 10 * i, 0, events.COLLECTIVE, events.START, "dist.all_reduce", {**STATIC, "seq": i}))
        out.append((3 * i, 10 * i + 1, 0, events.COLLECTIVE, events.END, "dist.all_reduce", None))
        out.append(
            (
                3 * i + 1,
                10 * i + 2,
                1,
                events.WAIT,
                events.START,
                "dist.all_reduce.wait",
                {**STATIC, "seq": i, "of": 3 * i},
            )
        )
    return out


def write_compact_calls(f: EventFile, records: list[events.RawEvent]) -> None:
    for r in records:
        info = r[6]
        if info is None:
            f.write_compact(r, None)
        elif "of" in info:
            f.write_compact(r, STATIC, ("seq", "of"))
        else:
            f.write_compact(r, STATIC, ("seq",))


def test_compact_records_read_back_as_the_records_written(tmp_path: Path) -> None:
    path = tmp_path / "events"
    f = EventFile(path)
    expected = compact_calls(50)
    f.write(record(0))  # marshalled records and compact ones interleave
    write_compact_calls(f, expected)
    f.write(record(1))
    assert list(read_raw(path)) == [record(0), *expected, record(1)]
    # once the templates are written, a record is 44 bytes: a third of the marshalled start
    before = f._pos
    write_compact_calls(f, expected)
    assert f._pos - before == 44 * len(expected)
    assert 4 + len(marshal.dumps(expected[0])) > 44 * 3
    f.close()


def test_a_reader_that_follows_the_file_knows_the_templates_of_earlier_reads(tmp_path: Path) -> None:
    path = tmp_path / "events"
    f = EventFile(path)
    reader = events.EventReader(path)
    calls = compact_calls(20)
    write_compact_calls(f, calls[:3])  # the templates are in this part
    assert reader.read_new() == calls[:3]
    assert reader.read_new() == []
    write_compact_calls(f, calls[3:])  # records only
    assert reader.read_new() == calls[3:]
    f.close()


def test_a_reader_reads_what_was_written_not_the_file_sized_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records across the reader's pieces, one larger than several pieces, and a reader
    that follows the file: all read once, in order; the zeros sized ahead are not read."""
    path = tmp_path / "events"
    f = EventFile(path)
    pread, read = os.pread, []
    monkeypatch.setattr(os, "pread", lambda fd, n, at: read.append(pread(fd, n, at)) or read[-1])
    tiny = EventFile(tmp_path / "tiny")
    tiny.write(record(0))
    assert list(read_raw(tmp_path / "tiny")) == [record(0)]
    assert 0 < sum(map(len, read)) <= 64 << 10 < os.path.getsize(tmp_path / "tiny")
    tiny.close()
    reader = events.EventReader(path)
    small = [record(i, size=100) for i in range(2_000)]  # ~250 KiB: several 64 KiB pieces
    large = record(10_000, size=300_000)
    for r in small[:1_000]:
        f.write(r)
    write_compact_calls(f, compact_calls(10))
    assert reader.read_new() == [*small[:1_000], *compact_calls(10)]
    f.write(large)
    for r in small[1_000:]:
        f.write(r)
    assert reader.read_new() == [large, *small[1_000:]]
    assert reader.read_new() == []
    assert reader.offset == f._pos < os.path.getsize(path)
    assert list(read_raw(path)) == [*small[:1_000], *compact_calls(10), large, *small[1_000:]]
    f.close()


def closed_compact_file(tmp_path: Path, n: int) -> tuple[Path, list[events.RawEvent], int]:
    """A closed file of n compact calls: its path, the records, and where they end."""
    path = tmp_path / "events"
    f = EventFile(path)
    calls = compact_calls(n)
    write_compact_calls(f, calls)
    f.close()
    return path, calls, f._pos


def test_a_torn_compact_record_is_the_end(tmp_path: Path) -> None:
    path, calls, end = closed_compact_file(tmp_path, 4)
    with open(path, "r+b") as out:
        out.truncate(end - 10)  # the last record lost part of its body
    assert list(read_raw(path)) == calls[:-1]
    with open(path, "r+b") as out:  # a compact tag whose template was never written
        out.seek(end - 44)
        out.write(struct.pack("<IQqIIqq", 0x80000000 | 40, 99, 1, 0, 999, 1, 0))
    assert list(read_raw(path)) == calls[:-1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_compact_records_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "events"
    calls = compact_calls(20_000)  # past the first MiB
    pid = os.fork()
    if pid == 0:
        try:
            write_compact_calls(EventFile(path), calls)
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert list(read_raw(path)) == calls
    assert path.stat().st_size > 1 << 20


def test_a_recorded_collective_and_its_wait_are_written_compact(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from pytest_ddphooks.recorder import distpatch

    distpatch.install()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        path = tmp_path / "events"
        with Recorder(0, 1, event_file=path) as rec:
            t = torch.ones(4)
            for _ in range(3):
                dist.all_reduce(t)
                dist.all_reduce(t, async_op=True).wait()
            written = list(read_raw(path))
            templates = len(rec._file._templates)
            raw = rec.records()
    finally:
        dist.destroy_process_group()
    assert written == raw
    collectives = [r for r in raw if r[3] in (events.COLLECTIVE, events.WAIT)]
    assert len(collectives) == 3 * (2 + 4)
    assert [r[6]["seq"] for r in collectives if r[4] == events.START and r[3] == events.COLLECTIVE] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    # the calls repeat: start and end of each form, the async end, the wait's start and end
    assert templates == 2 + 2 + 2


def test_past_the_template_limit_new_forms_are_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_TEMPLATES", 2)
    path = tmp_path / "events"
    f = EventFile(path)
    calls = compact_calls(5)  # three forms: the third (the wait) is past the limit
    write_compact_calls(f, calls)
    assert len(f._templates) == 2
    assert list(read_raw(path)) == calls
    f.close()


def test_a_compact_record_whose_body_is_not_visible_yet_is_read_later(tmp_path: Path) -> None:
    path, calls, end = closed_compact_file(tmp_path, 2)
    reader = events.EventReader(path)
    body = path.read_bytes()[end - 40 : end]
    with open(path, "r+b") as out:  # the tag is there, the body still zeros (another CPU's view)
        out.seek(end - 40)
        out.write(bytes(40))
    assert reader.read_new() == calls[:-1]
    with open(path, "r+b") as out:
        out.seek(end - 40)
        out.write(body)
    assert reader.read_new() == calls[-1:]


def test_an_event_file_with_no_room_to_grow_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing into a full filesystem would kill the process at its next write (SIGBUS): the
    growth is refused with the words that name the problem instead."""
    f = EventFile(tmp_path / "events")
    f.write(record(0))
    full = os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(os, "fstatvfs", lambda fd: full)
    with pytest.raises(OSError, match=r"no room for the event file .*events to grow to 2 MiB \(0 KiB free"):
        for i in range(1, 20_000):
            f.write(record(i, size=100))
    monkeypatch.undo()
    assert len(list(read_raw(tmp_path / "events"))) > 1_000, "what was written before stays readable"
    f.close()


def _tracked_after(record: Callable[[], None], n: int) -> int:
    """How many more objects the garbage collector tracks after ``n`` calls of ``record``."""
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(n):
        record()
    gc.collect()
    gc.collect()  # a tuple is let go of once what it holds was, one collection later
    return len(gc.get_objects()) - before


def test_what_a_recorder_keeps_of_a_call_is_nothing_the_collector_walks(tmp_path: Path) -> None:
    # a full collection walks every object it tracks: a call's start event kept with its info
    # dict would be one more for each call, for as long as the recorder lives
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from pytest_ddphooks.recorder import distpatch

    class Hooks:
        def step(self) -> None:
            pass

    distpatch.install()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with Recorder(0, 1, event_file=tmp_path / "events") as rec:
            hooks = rec.instrument(Hooks(), "step")
            t = torch.ones(4)
            hooks.step()  # the first call of each kind describes its form
            dist.all_reduce(t)
            assert _tracked_after(hooks.step, 2_000) < 100
            assert _tracked_after(lambda: dist.all_reduce(t), 2_000) < 100
            assert _tracked_after(lambda: dist.all_reduce(t, async_op=True).wait(), 1_000) < 100
            raw = rec.records()
    finally:
        dist.destroy_process_group()
    # and every record reads back whole
    starts = [r for r in raw if r[3] == events.COLLECTIVE and r[4] == events.START]
    assert len(starts) == 1 + 2_000 + 1_000
    assert [r[6]["seq"] for r in starts[-3:]] == [2_999, 3_000, 3_001]
    assert all(r[6]["op"] == "all_reduce" and r[6]["payload"] == "float32[4]" for r in starts)
    steps = [r for r in raw if r[5] == "step" and r[4] == events.START]
    assert len(steps) == 2_001 and all(r[6] == {"qualname": steps[0][6]["qualname"]} for r in steps)
