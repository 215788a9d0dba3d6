"""A framework barrier is recorded over what it really runs, whatever its shape: a coroutine
over its awaited body, a generator over its steps, a ``@contextmanager`` over the ``with``
statement; and only its own code's collectives count (not its caller's ``with`` block, not a
task or thread that was there before it)."""

from __future__ import annotations

import pytest

PRELUDE = """
import asyncio
import contextlib
import fnmatch
import threading
import time
import pytest
import torch
import torch.distributed as dist
from pytest_ddphooks import TimelineAssertionError

def wait_for(path):
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)

NOOP = "issued no collective: the process group existed but no collective was called"
"""


def run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makepyfile(test_shapes=PRELUDE + body)
    return pytester.runpytest("-p", "no:cacheprovider")


def test_a_coroutine_barrier_spans_its_awaited_body(pytester) -> None:
    """Recorded at the coroutine's creation, rank 0's barrier 'ended' before rank 1's b although
    it returned only after b (it waited for a file rank 1 wrote after b): a false proof."""
    result = run(
        pytester,
        """
class Strategy:
    def __init__(self, flag=None):
        self.flag = flag

    async def barrier(self):
        if self.flag is not None:
            await asyncio.to_thread(wait_for, self.flag)  # no collective: ends after rank 1's b
        else:
            dist.barrier()

@pytest.mark.multirank(world_size=2)
def test_inverted_order_refused(rank, recorder, shared_tmp_path):
    flag = shared_tmp_path / "b-done"
    recorder.instrument_barrier(Strategy, "barrier")

    async def main():
        if rank == 0:
            pending = asyncio.ensure_future(Strategy(flag).barrier())  # its body runs at the await
            dist.all_reduce(torch.ones(1))
            await pending
        else:
            dist.all_reduce(torch.ones(1))
            recorder.mark("b")
            flag.write_text("done")

    asyncio.run(main())
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError):
        tl.assert_happens_before("barrier@0", "b@1")
    assert [(nb.rank, nb.reason) for nb in tl.noop_barriers()] == [(0, NOOP)]

@pytest.mark.multirank(world_size=2)
def test_awaiting_a_real_barrier_is_no_noop(rank, recorder):
    recorder.instrument_barrier(Strategy, "barrier")
    if rank == 0:
        recorder.mark("prepare")
    asyncio.run(Strategy().barrier())
    recorder.mark("setup")
    tl = recorder.timeline()
    assert tl.noop_barriers() == []
    tl.assert_happens_before("prepare@0", "setup@1")

EMPTY = "issued only collectives on tensors with no element, which wait for nobody"

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize(("own", "reason"), [("nothing", NOOP), ("empty", EMPTY)])
def test_another_tasks_collective_is_not_the_barriers(rank, recorder, own, reason):
    class Idle:
        def __init__(self):
            self.begun, self.done = asyncio.Event(), asyncio.Event()

        async def barrier(self):
            if own == "empty":  # its own collective waits for nobody: the other task's does not help it
                dist.all_reduce(torch.empty(0))
            self.begun.set()
            await self.done.wait()  # synchronises nothing itself: the other task's all-reduce runs meanwhile

    recorder.instrument_barrier(Idle, "barrier")

    async def other(idle):
        await idle.begun.wait()
        dist.all_reduce(torch.ones(1))
        idle.done.set()

    async def main():
        idle = Idle()
        started = asyncio.ensure_future(other(idle))
        await idle.barrier()
        await started

    asyncio.run(main())
    assert [nb.reason for nb in recorder.timeline().noop_barriers()] == [reason] * 2
""",
    )
    result.assert_outcomes(passed=4)


def test_a_generator_barrier_counts_its_own_steps(pytester) -> None:
    result = run(
        pytester,
        """
class Strategy:
    def idle(self):
        yield  # synchronises nothing

    def real(self):
        dist.barrier()
        yield

@pytest.mark.multirank(world_size=2)
def test_idle_generator_is_a_noop(rank, recorder):
    recorder.instrument_barrier(Strategy, "idle")
    for _ in Strategy().idle():
        dist.all_reduce(torch.ones(1))  # its consumer's, not the barrier's
    assert [nb.reason for nb in recorder.timeline().noop_barriers()] == [NOOP] * 2

@pytest.mark.multirank(world_size=2)
def test_real_generator_is_no_noop(rank, recorder):
    recorder.instrument_barrier(Strategy, "real")
    for _ in Strategy().real():
        pass
    assert recorder.timeline().noop_barriers() == []
""",
    )
    result.assert_outcomes(passed=2)


def test_a_contextmanager_barrier_spans_the_with_statement(pytester) -> None:
    """Fabric's rank_zero_first and Accelerate's main_process_first are of this shape: the
    barrier runs on entering on some ranks and on leaving on others."""
    result = run(
        pytester,
        """
class Strategy:
    @contextlib.contextmanager
    def rank_zero_first(self):
        if dist.get_rank() > 0:
            dist.barrier()
        yield
        if dist.get_rank() == 0:
            dist.barrier()

    @contextlib.contextmanager
    def guarded(self):
        if dist.get_rank() > 0:
            dist.barrier()
        try:
            yield
        finally:
            if dist.get_rank() == 0:
                dist.barrier()

    @contextlib.contextmanager
    def idle(self):
        yield

    @contextlib.asynccontextmanager
    async def async_first(self):
        if dist.get_rank() > 0:
            dist.barrier()
        yield
        if dist.get_rank() == 0:
            dist.barrier()

@pytest.mark.multirank(world_size=2)
def test_rank_zero_first_orders_and_is_no_noop(rank, recorder):
    recorder.instrument_barrier(Strategy, "rank_zero_first")
    with Strategy().rank_zero_first():
        recorder.mark("download")
    tl = recorder.timeline()
    assert tl.noop_barriers() == []
    tl.assert_happens_before("download@0", "download@1")
    with pytest.raises(TimelineAssertionError):
        tl.assert_happens_before("download@1", "download@0")

@pytest.mark.multirank(world_size=2)
def test_async_rank_zero_first_is_no_noop(rank, recorder):
    recorder.instrument_barrier(Strategy, "async_first")

    async def main():
        async with Strategy().async_first():
            recorder.mark("download")

    asyncio.run(main())
    tl = recorder.timeline()
    assert tl.noop_barriers() == []
    tl.assert_happens_before("download@0", "download@1")

@pytest.mark.multirank(world_size=2)
def test_idle_manager_is_a_noop_whatever_its_block_does(rank, recorder):
    recorder.instrument_barrier(Strategy, "idle")
    with Strategy().idle():
        dist.all_reduce(torch.ones(1))
    assert [nb.reason for nb in recorder.timeline().noop_barriers()] == [NOOP] * 2

@pytest.mark.multirank(world_size=2)
def test_an_error_in_the_block_reaches_the_manager(rank, recorder):
    recorder.instrument_barrier(Strategy, "guarded")
    with pytest.raises(KeyError):
        with Strategy().guarded():
            raise KeyError("inside")
    tl = recorder.timeline()
    (end,) = [e for e in tl.for_rank(rank) if e.name == "guarded" and e.phase == "end"]
    assert end.info["error"].startswith("KeyError")
    assert tl.noop_barriers() == []
""",
    )
    result.assert_outcomes(passed=4)


def test_a_thread_running_before_the_barrier_does_not_synchronise_for_it(pytester) -> None:
    """Its first recorded event may fall inside the barrier: it is still not the barrier's."""
    result = run(
        pytester,
        """
class Strategy:
    def idle(self, begun, until):
        begun.set()
        until.wait(30)  # synchronises nothing itself: the heartbeat's all-reduce runs meanwhile

    def through_a_thread(self):
        worker = threading.Thread(target=dist.barrier)
        worker.start()
        worker.join()

@pytest.mark.multirank(world_size=2)
def test_heartbeat_does_not_hide_a_noop(rank, recorder):
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "idle")
    begun, beat = threading.Event(), threading.Event()

    def heartbeat():  # its first recorded event comes after the barrier began
        begun.wait(30)
        dist.all_reduce(torch.ones(1))
        beat.set()

    thread = threading.Thread(target=heartbeat)
    thread.start()
    strategy.idle(begun, beat)
    thread.join()
    assert [nb.reason for nb in recorder.timeline().noop_barriers()] == [NOOP] * 2

@pytest.mark.multirank(world_size=2)
def test_a_thread_the_barrier_starts_synchronises_for_it(rank, recorder):
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "through_a_thread")
    strategy.through_a_thread()
    assert recorder.timeline().noop_barriers() == []
""",
    )
    result.assert_outcomes(passed=2)


def test_a_decorated_barrier_spans_what_its_call_returns(pytester) -> None:
    """A plain decorator in front of a coroutine or @contextmanager function: recorded over the
    call that makes the coroutine or the manager, rank 0's barrier 'ended' before rank 1's b
    although it returned after it (a false proof)."""
    result = run(
        pytester,
        """
import functools

def traced(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

class Strategy:
    @traced
    async def barrier(self, flag):
        if flag is not None:
            await asyncio.to_thread(wait_for, flag)

    @traced
    @contextlib.contextmanager
    def entered(self, flag):
        if flag is not None:
            wait_for(flag)
        yield

    @contextlib.contextmanager
    def idle(self):
        yield

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("shape", ["coroutine", "manager"])
def test_inverted_order_refused(rank, recorder, shared_tmp_path, shape):
    flag = shared_tmp_path / "b-done"
    recorder.instrument_barrier(Strategy, "barrier" if shape == "coroutine" else "entered")
    if rank == 0:
        # made first, run after the all-reduce: its body waits for rank 1's b
        made = Strategy().barrier(flag) if shape == "coroutine" else Strategy().entered(flag)
        dist.all_reduce(torch.ones(1))
        if shape == "coroutine":
            asyncio.run(made)
        else:
            with made:
                pass
    else:
        dist.all_reduce(torch.ones(1))
        recorder.mark("b")
        flag.write_text("done")
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError):
        tl.assert_happens_before(("barrier" if shape == "coroutine" else "entered") + "@0", "b@1")

@pytest.mark.multirank(world_size=2)
def test_a_manager_used_as_a_decorator_is_recorded_at_each_call(rank, recorder):
    recorder.instrument_barrier(Strategy, "idle")

    @Strategy().idle()
    def work():
        recorder.mark("work")

    work()
    work()
    tl = recorder.timeline()
    assert len(tl.spans("idle")) == 4
    assert [nb.reason for nb in tl.noop_barriers()] == [NOOP] * 4

def test_a_special_method_of_one_object_is_refused(recorder):
    class Barrier:
        def __call__(self):
            pass

    with pytest.raises(TypeError, match="Python looks special methods up on the class"):
        recorder.instrument_barrier(Barrier(), "__call__")
""",
    )
    result.assert_outcomes(passed=4)


def test_a_barrier_is_judged_by_its_own_collectives_only(pytester) -> None:
    """A barrier whose own collective waits for nobody (not waited for, no element) was taken as
    synchronising when its caller's ``with`` block (or a task that was there before it, above)
    issued a real collective while it ran: only what its own code issued is judged."""
    result = run(
        pytester,
        """
class Strategy:
    work = None

    @contextlib.contextmanager
    def unwaited(self):
        self.work = dist.all_reduce(torch.ones(1), async_op=True)  # waited for after the with
        yield

    @contextlib.contextmanager
    def empty(self):
        dist.all_reduce(torch.empty(0))
        yield

    @contextlib.contextmanager
    def waited(self):
        dist.all_reduce(torch.ones(1), async_op=True).wait()
        yield

ASYNC = "issued only asynchronous collectives, and waited for none of them before it returned"
EMPTY = "issued only collectives on tensors with no element, which wait for nobody"

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize(("shape", "reason"), [("unwaited", ASYNC), ("empty", EMPTY), ("waited", None)])
def test_the_with_block_is_not_the_barriers(rank, recorder, shape, reason):
    strategy = recorder.instrument_barrier(Strategy(), shape)
    with getattr(strategy, shape)():
        dist.all_reduce(torch.ones(2))  # the caller's: synchronises, but not for the barrier
    if strategy.work is not None:
        strategy.work.wait()
    found = [(nb.rank, nb.reason) for nb in recorder.timeline().noop_barriers()]
    assert found == ([] if reason is None else [(0, reason), (1, reason)])
""",
    )
    result.assert_outcomes(passed=3)


def test_collectives_that_each_wait_for_nobody_make_a_noop_whatever_the_reasons(pytester) -> None:
    """Named only when every collective inside waited for nobody for one and the same reason, a
    barrier of a solo-group barrier and an empty all-reduce returned in milliseconds on rank 0
    while rank 1 came a second later, and was not named."""
    result = run(
        pytester,
        """
class Strategy:
    def __init__(self, solo):
        self.solo = solo

    def mixed(self):
        dist.barrier(group=self.solo)  # a group of this rank alone
        dist.all_reduce(torch.empty(0))  # no element

    def mixed_with_a_real_one(self):
        dist.barrier(group=self.solo)
        dist.all_reduce(torch.empty(0))
        dist.barrier()

    def through_ddp(self):
        dist.all_reduce(torch.empty(0))
        # DDP's constructor broadcasts rank 0's parameters from native code, which waits for every rank
        self.model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))

    def through_a_thread(self):
        dist.all_reduce(torch.empty(0))
        worker = threading.Thread(target=dist.barrier)  # a plain thread: not the barrier's context
        worker.start()
        worker.join()

    def hollow_ddp(self):  # native collectives on a group of this rank alone wait for nobody either
        dist.all_reduce(torch.empty(0))
        self.model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), process_group=self.solo)

    def hollow_thread(self):
        dist.all_reduce(torch.empty(0))
        worker = threading.Thread(target=dist.all_reduce, args=(torch.empty(0),))
        worker.start()
        worker.join()

    def bad_group(self):
        try:  # torch refuses a group given by a name: no collective, and none the recorder could number
            dist.barrier(group="no-such-group")
        except ValueError:
            pass
        dist.all_reduce(torch.empty(0))

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize(
    ("shape", "each"),
    [
        ("mixed", "barrier #1 was on a group of this rank alone, all_reduce #1 had no element"),
        ("bad_group", "all_reduce #1 had no element, barrier raised"),  # a call of no group
        ("hollow_ddp", "all_reduce #1 had no element, all_gather #1 was on a group of this rank alone, *"),
        ("hollow_thread", "issued only collectives on tensors with no element, which wait for nobody"),
    ],
)
def test_mixed_reasons_are_named_together(rank, recorder, shape, each):
    solos = [dist.new_group([0]), dist.new_group([1])]
    strategy = recorder.instrument_barrier(Strategy(solos[rank]), shape)
    getattr(strategy, shape)()
    found = recorder.timeline().noop_barriers()
    assert [nb.rank for nb in found] == [0, 1]
    mixed = "issued only collectives that synchronised it with nobody before it returned: "
    reason = each if each.startswith("issued") else mixed + each
    assert fnmatch.fnmatch(found[0].reason, reason), found[0].reason

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("shape", ["mixed_with_a_real_one", "through_ddp", "through_a_thread"])
def test_one_real_collective_among_them_synchronises(rank, recorder, shape):
    # a real one of its own, of native code on its thread, or of a thread it started and joined
    solos = [dist.new_group([0]), dist.new_group([1])]
    strategy = recorder.instrument_barrier(Strategy(solos[rank]), shape)
    getattr(strategy, shape)()
    assert recorder.timeline().noop_barriers() == []
""",
    )
    result.assert_outcomes(passed=7)


def test_a_collective_on_a_thread_the_barrier_did_not_wait_for_synchronises_nothing(pytester) -> None:
    """``asyncio.to_thread`` gives the thread the barrier's context, so its collective counted as
    the barrier's own; the barrier returned before it completed (rank 1 came later), and it was
    not named, since its collective ran on another thread."""
    result = run(
        pytester,
        """
THREAD = "issued only collectives on threads it started, and waited for none of them before it returned"

class Strategy:
    def __init__(self, recorder):
        self.recorder, self.task = recorder, None

    async def hand_off(self):
        self.task = asyncio.ensure_future(asyncio.to_thread(dist.barrier))
        # returns once its thread is inside dist.barrier, which waits for rank 1 yet
        while not self.recorder.occurrences(lambda kind, phase, name: name == "dist.barrier"):
            await asyncio.sleep(0.001)

    async def await_it(self):
        await asyncio.to_thread(dist.barrier)

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize(("shape", "reason"), [("hand_off", THREAD), ("await_it", None)])
def test_the_thread_counts_once_completed(rank, recorder, shared_tmp_path, shape, reason):
    flag = shared_tmp_path / "returned"
    if rank == 0:
        strategy = recorder.instrument_barrier(Strategy(recorder), shape)

        async def main():
            if shape == "await_it":
                flag.write_text("go")
            await getattr(strategy, shape)()
            flag.write_text("go")  # rank 1 enters its barrier only after rank 0's returned
            if strategy.task is not None:
                await strategy.task

        asyncio.run(main())
    else:
        wait_for(flag)
        dist.barrier()
    found = [(nb.rank, nb.reason) for nb in recorder.timeline().noop_barriers()]
    assert found == ([] if reason is None else [(0, reason)])
""",
    )
    result.assert_outcomes(passed=2)
