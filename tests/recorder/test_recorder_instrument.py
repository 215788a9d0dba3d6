"""Recorder.instrument and friends: what is wrapped, what is recorded, what close() undoes."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest

from pytest_ddphooks.recorder import Recorder, core, events


class Base:
    def inherited(self) -> str:
        return "base"


class Hooks(Base):
    label = "hooks"

    def on_start(self, x: int) -> int:
        return x + 1

    def on_end(self, *, y: int = 0) -> int:
        return y

    @staticmethod
    def helper(x: int) -> int:
        return x * 2

    @classmethod
    def build(cls, n: int) -> tuple[str, int]:
        return cls.__name__, n

    def fails(self) -> None:
        raise KeyError("boom")

    async def on_async(self, x: int) -> int:
        await asyncio.sleep(0)
        return x

    async def async_fails(self) -> None:
        await asyncio.sleep(0)
        raise ValueError("async boom")

    @property
    def prop(self) -> int:
        return 1

    def _private(self) -> None:
        pass


def names(rec: Recorder) -> list[tuple[str, str]]:
    return [(e.name, e.phase) for e in rec.events if e.kind == events.CALL]


def test_instrument_a_class_affects_every_instance() -> None:
    rec = Recorder(0, 1)
    try:
        rec.instrument(Hooks, "on_start")
        a, b = Hooks(), Hooks()
        assert a.on_start(1) == 2
        assert b.on_start(2) == 3
        assert names(rec) == [("on_start", "start"), ("on_start", "end")] * 2
        start = rec.events[0]
        assert start.info == {"qualname": "Hooks.on_start"}
        assert rec.events[1].info == {}
        assert start.lane == 0
    finally:
        rec.close()
    assert Hooks.on_start is vars(Hooks)["on_start"]
    assert Hooks().on_start(1) == 2
    assert names(rec) == [("on_start", "start"), ("on_start", "end")] * 2  # no more


def test_instrument_an_instance_affects_only_it() -> None:
    rec = Recorder(0, 1)
    a, b = Hooks(), Hooks()
    try:
        assert rec.instrument(a, "on_start", "on_end") is a
        assert a.on_start(1) == 2
        assert a.on_end(y=5) == 5
        assert b.on_start(1) == 2
        assert names(rec) == [("on_start", "start"), ("on_start", "end"), ("on_end", "start"), ("on_end", "end")]
    finally:
        rec.close()
    assert "on_start" not in vars(a)
    assert a.on_start(1) == 2
    assert len(names(rec)) == 4


def test_an_instance_attribute_of_its_own_is_put_back() -> None:
    a = Hooks()
    own = lambda: "own"  # noqa: E731
    a.on_start = own  # type: ignore[method-assign]
    rec = Recorder(0, 1)
    rec.instrument(a, "on_start")
    assert a.on_start() == "own"
    rec.close()
    assert a.on_start is own


def test_static_and_class_methods_on_the_class_and_on_an_instance() -> None:
    rec = Recorder(0, 1)
    try:
        rec.instrument(Hooks, "helper", "build")
        assert isinstance(vars(Hooks)["helper"], staticmethod)
        assert isinstance(vars(Hooks)["build"], classmethod)
        assert Hooks.helper(2) == 4
        assert Hooks().helper(3) == 6
        assert Hooks.build(1) == ("Hooks", 1)

        class Sub(Hooks):
            pass

        assert Sub().build(2) == ("Sub", 2)
        assert [n for n, p in names(rec) if p == "start"] == ["helper", "helper", "build", "build"]
    finally:
        rec.close()
    assert isinstance(vars(Hooks)["helper"], staticmethod)
    assert isinstance(vars(Hooks)["build"], classmethod)
    assert not hasattr(vars(Hooks)["helper"].__func__, "__wrapped__")

    obj = Hooks()
    rec = Recorder(0, 1)
    try:
        rec.instrument(obj, "helper", "build")
        assert obj.helper(5) == 10
        assert obj.build(3) == ("Hooks", 3)
        assert [n for n, p in names(rec) if p == "start"] == ["helper", "build"]
    finally:
        rec.close()
    assert vars(obj) == {}


def test_default_names_are_the_public_methods_the_class_itself_defines() -> None:
    rec = Recorder(0, 1)
    try:
        rec.instrument(Hooks)
        wrapped = {n for n, v in vars(Hooks).items() if hasattr(getattr(v, "__func__", v), "__wrapped__")}
        assert wrapped == {"on_start", "on_end", "helper", "build", "fails", "on_async", "async_fails"}
        h = Hooks()
        assert h.inherited() == "base"
        assert h.prop == 1
        h._private()
        assert names(rec) == []
    finally:
        rec.close()


def test_a_class_without_public_methods_is_refused() -> None:
    class Empty:
        def _hidden(self) -> None:
            pass

    with pytest.raises(ValueError, match="defines no public method"):
        Recorder(0, 1).instrument(Empty)


def test_prefix_names_the_events() -> None:
    rec = Recorder(0, 1)
    h = Hooks()
    try:
        rec.instrument(h, "on_start", prefix="model")
        h.on_start(0)
    finally:
        rec.close()
    assert names(rec) == [("model.on_start", "start"), ("model.on_start", "end")]


def test_an_exception_is_recorded_on_the_end_event_and_raised() -> None:
    rec = Recorder(0, 1)
    try:
        rec.instrument(Hooks, "fails")
        with pytest.raises(KeyError, match="boom"):
            Hooks().fails()
    finally:
        rec.close()
    start, end = [e for e in rec.events if e.kind == events.CALL]
    assert end.phase == events.END and end.call_id == start.call_id
    assert end.info == {"error": "KeyError: 'boom'"}
    span = rec.timeline().spans("fails")[0]
    assert span.end == end


def test_a_long_error_is_shortened() -> None:
    class Loud:
        def shout(self) -> None:
            raise RuntimeError("x" * 1000)

    rec = Recorder(0, 1)
    obj = rec.instrument(Loud())
    with pytest.raises(RuntimeError):
        obj.shout()
    rec.close()
    text = rec.events[-1].info["error"]
    assert len(text) == 300 and text.endswith("...")


def test_coroutine_methods_are_recorded_around_their_body() -> None:
    rec = Recorder(0, 1)
    try:
        rec.instrument(Hooks, "on_async", "async_fails")
        assert inspect.iscoroutinefunction(Hooks.on_async)
        h = Hooks()

        async def main() -> int:
            coro = h.on_async(7)
            rec.mark("created")
            result = await coro
            with pytest.raises(ValueError):
                await h.async_fails()
            return result

        assert asyncio.run(main()) == 7
    finally:
        rec.close()
    seen = [(e.name, e.phase) for e in rec.events if e.kind in (events.CALL, events.MARK)]
    assert seen == [
        ("created", "point"),
        ("on_async", "start"),
        ("on_async", "end"),
        ("async_fails", "start"),
        ("async_fails", "end"),
    ]
    assert rec.events[-1].info == {"error": "ValueError: async boom"}


def test_what_cannot_be_instrumented() -> None:
    rec = Recorder(0, 1)
    with pytest.raises(AttributeError, match=r"cannot instrument Hooks\.missing: no such attribute"):
        rec.instrument(Hooks, "missing")
    with pytest.raises(TypeError, match="it is not a method"):
        rec.instrument(Hooks, "label")

    class Slotted:
        __slots__ = ()

        def run(self) -> None:
            pass

    with pytest.raises(TypeError, match="instrument its class instead"):
        rec.instrument(Slotted(), "run")
    rec.close()


def test_instrumenting_twice_records_twice_and_close_undoes_both() -> None:
    original = vars(Hooks)["on_start"]
    rec = Recorder(0, 1)
    rec.instrument(Hooks, "on_start")
    rec.instrument(Hooks, "on_start", prefix="again")
    Hooks().on_start(1)
    rec.close()
    assert [n for n, p in names(rec) if p == "start"] == ["again.on_start", "on_start"]
    assert vars(Hooks)["on_start"] is original


class Strategy:
    def barrier(self) -> str:
        return "synced"

    def setup(self) -> None:
        pass


def starts(rec: Recorder) -> list[tuple[str, str]]:
    return [(e.kind, e.name) for e in rec.events if e.phase == events.START]


@pytest.mark.parametrize("on", ["instance", "class", "class-then-instance"])
@pytest.mark.parametrize("barrier_first", [False, True])
def test_a_method_instrumented_as_a_call_and_as_a_barrier_is_recorded_once_as_the_barrier(
    on: str, barrier_first: bool
) -> None:
    original = vars(Strategy)["barrier"]
    s = Strategy()
    rec = Recorder(0, 1)
    call_target = Strategy if on != "instance" else s
    barrier_target = s if on != "class" else Strategy
    steps = [lambda: rec.instrument(call_target), lambda: rec.instrument_barrier(barrier_target, "barrier")]
    for step in reversed(steps) if barrier_first else steps:
        step()
    assert s.barrier() == "synced"
    s.setup()
    rec.close()
    assert starts(rec) == [(events.BARRIER, "barrier"), (events.CALL, "setup")]
    assert vars(Strategy)["barrier"] is original and "barrier" not in vars(s)


def test_a_barrier_under_another_name_is_another_instrumentation() -> None:
    rec = Recorder(0, 1)
    s = rec.instrument(Strategy())
    rec.instrument_barrier(s, "barrier", as_name="strategy.barrier")
    s.barrier()
    rec.close()
    assert starts(rec) == [(events.BARRIER, "strategy.barrier"), (events.CALL, "barrier")]


def test_inherited_methods_instrumented_on_a_subclass_are_removed_again() -> None:
    class Child(Hooks):
        pass

    rec = Recorder(0, 1)
    rec.instrument(Child, "on_start", "inherited")
    assert Child().inherited() == "base"
    assert Hooks().inherited() == "base"
    rec.close()
    assert "on_start" not in vars(Child) and "inherited" not in vars(Child)
    assert [n for n, p in names(rec) if p == "start"] == ["inherited"]


def test_threads_get_their_own_lanes_and_names() -> None:
    rec = Recorder(0, 1)
    h = rec.instrument(Hooks(), "on_start")
    h.on_start(0)
    t = threading.Thread(target=h.on_start, args=(1,), name="loader")
    t.start()
    t.join()
    rec.close()
    lanes = {e.lane for e in rec.events}
    assert lanes == {0, 1}
    tl = rec.timeline()
    assert tl.lanes[(0, 1)] == "loader"
    assert tl.lanes[(0, 0)] == threading.main_thread().name


def test_a_thread_given_the_id_of_one_that_ended_gets_a_lane_of_its_own() -> None:
    """The system hands a new thread the id of one that ended: one lane for both would put
    them in one program order, which nothing in the code gave them."""
    rec = Recorder(0, 1)
    idents = []

    def mark(name: str) -> None:
        idents.append(threading.get_ident())
        rec.mark(name)

    for name in ("a", "b"):
        t = threading.Thread(target=mark, args=(name,))
        t.start()
        t.join()
    rec.close()
    lanes = {e.name: e.lane for e in rec.events}
    assert lanes["a"] != lanes["b"] and 0 not in (lanes["a"], lanes["b"]), (lanes, idents)


def test_marks_keep_their_details() -> None:
    rec = Recorder(0, 1)
    rec.mark("epoch", n=3, where=("a", 1), obj=object)
    rec.close()
    (e,) = rec.events
    assert (e.kind, e.phase, e.name) == (events.MARK, events.POINT, "epoch")
    assert e.info["n"] == 3 and e.info["where"] == ["a", 1] and e.info["obj"] == repr(object)


def test_recorders_closed_out_of_order_leave_the_right_one_current() -> None:
    assert core.current() is None
    a = Recorder(0, 1).activate()
    b = Recorder(0, 1).activate()
    assert core.current() is b
    a.close()
    assert core.current() is b  # b keeps recording
    c = Recorder(0, 1).activate()
    c.close()
    assert core.current() is b
    b.close()
    assert core.current() is None  # not a, which was closed already
    with Recorder(0, 1) as d:
        assert core.current() is d
        d.activate()  # twice is harmless
    assert core.current() is None


def test_rank_and_world_size_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rec = Recorder()
    assert (rec.rank, rec.world_size) == (3, 4)
    rec.mark("x")
    assert rec.timeline().ranks == [3]
    rec.close()


def test_timeline_through_an_exchange() -> None:
    import marshal

    other = Recorder(1, 2)
    other.mark("from_one")

    def exchange(blob: bytes) -> list[bytes]:
        return [blob, marshal.dumps(other.records())]

    rec = Recorder(0, 2, exchange=exchange)
    rec.mark("from_zero")
    tl = rec.timeline()
    assert tl.ranks == [0, 1]
    assert [e.name for e in tl.for_rank(1)] == ["from_one"]
    rec.close()
    other.close()


class Steps:
    def __init__(self) -> None:
        self.done: list[str] = []

    def prepare(self) -> object:
        self.done.append("body")
        yield 1
        yield 2

    async def stream(self) -> object:
        yield "a"

    def scale(self, x: float) -> float:
        return x * len(self.done)


def test_a_generator_method_is_recorded_around_its_body_not_its_creation() -> None:
    steps = Steps()
    with Recorder(0, 1) as rec:
        rec.instrument(steps, "prepare", "stream")
        made = steps.prepare()
        rec.mark("created")
        assert list(made) == [1, 2]
        left = steps.prepare()
        next(left)
        left.close()

        async def consume() -> list[str]:
            return [x async for x in steps.stream()]

        assert asyncio.run(consume()) == ["a"]
    seen = [(e.name, e.phase, e.info.get("closed")) for e in rec.events if e.kind in (events.CALL, events.MARK)]
    assert seen == [
        ("created", "point", None),
        ("prepare", "start", None),
        ("prepare", "end", None),
        ("prepare", "start", None),
        ("prepare", "end", True),  # left before its end
        ("stream", "start", None),
        ("stream", "end", None),
    ]


def test_a_deep_copy_of_an_instrumented_object_runs_its_own_method_and_it_pickles() -> None:
    import copy
    import pickle

    original = Steps()
    with Recorder(0, 1) as rec:
        rec.instrument(original, "scale")
        twin = copy.deepcopy(original)
        twin.done.extend(["x", "y"])
        assert original.scale(10.0) == 0.0
        assert twin.scale(10.0) == 20.0  # its own state, not the original's
        loaded = pickle.loads(pickle.dumps(original))
        loaded.done.append("z")
        assert loaded.scale(1.0) == 1.0
    assert [(e.name, e.phase) for e in rec.events if e.kind == events.CALL] == [("scale", "start"), ("scale", "end")]


@pytest.mark.parametrize("first", ["class", "object"])
def test_recorders_closed_out_of_order_leave_nothing_behind(first: str) -> None:
    original = Steps.scale
    steps = Steps()
    target = Steps if first == "class" else steps
    outer, inner = Recorder(0, 1), Recorder(0, 1)
    outer.instrument(target, "scale")
    inner.instrument(target, "scale", prefix="inner")
    assert steps.scale(1.0) == 0.0
    outer.close()  # first opened, first closed: the inner wrapper stays until its recorder closes
    assert steps.scale(1.0) == 0.0
    inner.close()
    assert Steps.scale is original and "scale" not in vars(steps)
    assert [e.name for e in inner.events if e.phase == "start"] == ["inner.scale", "inner.scale"]


def test_a_closed_recorder_refuses_to_record_and_leaves_nothing_patched() -> None:
    class Model:
        def step(self) -> int:
            return 1

    original = Model.__dict__["step"]
    rec = Recorder()
    with rec:
        Model().step()
    for attempt in (lambda: rec.instrument(Model, "step"), lambda: rec.instrument_barrier(Model, "step")):
        with pytest.raises(RuntimeError, match=r"this Recorder was closed .*: use a new one"):
            attempt()
    with pytest.raises(RuntimeError, match=r"mark\(\): this Recorder was closed"):
        rec.mark("late")
    with pytest.raises(RuntimeError, match=r"activate\(\): this Recorder was closed"):
        rec.activate()
    assert Model.__dict__["step"] is original


def test_names_are_given_one_by_one_and_a_mark_may_carry_any_detail() -> None:
    class Model:
        def step(self) -> int:
            return 1

    with Recorder() as rec:
        with pytest.raises(TypeError, match=r"instrument\(\) takes the names of methods one by one, as strings"):
            rec.instrument(Model, ["step"])  # type: ignore[arg-type]
        rec.mark("epoch", name="first", n=1)
        [mark] = [e for e in rec.events if e.kind == "mark"]
        assert (mark.name, mark.info) == ("epoch", {"name": "first", "n": 1})


def test_a_module_with_no_names_has_each_public_function_it_defines_instrumented(tmp_path, monkeypatch) -> None:
    (tmp_path / "steps_mod.py").write_text(
        "from os.path import join\n\ndef load():\n    return 1\n\ndef train():\n    return load() + 1\n\n"
        "def _helper():\n    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import steps_mod

    with Recorder() as rec:
        rec.instrument(steps_mod)
        assert steps_mod.train() == 2
        assert steps_mod.join("a", "b") == "a/b"  # imported, not its own: untouched
        names = [(e.name, e.phase) for e in rec.events]
    assert names == [("train", "start"), ("load", "start"), ("load", "end"), ("train", "end")]
    empty = type(steps_mod)("empty_mod")
    with Recorder() as rec, pytest.raises(ValueError, match="module empty_mod defines no public function"):
        rec.instrument(empty)
