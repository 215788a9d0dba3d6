"""assert_order, assert_called_once, selectors, and collective mismatches."""

from __future__ import annotations

import pytest
from synth import Sim

from pytest_ddphooks.recorder import Mismatch, Timeline, TimelineAssertionError, events
from pytest_ddphooks.recorder.timeline import parse_selector


def message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """The explanation, without the swimlanes drawn under it."""
    return str(excinfo.value).split("\n\n", 1)[0]


def test_timeline_assertion_error_is_an_assertion_error() -> None:
    assert issubclass(TimelineAssertionError, AssertionError)


# -- selectors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "parsed"),
    [
        ("setup", ("setup", None)),
        ("setup@0", ("setup", (0,))),
        ("setup@0,2", ("setup", (0, 2))),
        ("model.setup@1", ("model.setup", (1,))),
        ("user@host", ("user@host", None)),
        ("odd@", ("odd@", None)),
        # a digit only to str.isdigit(): a name, which the timeline then does not hold (int() refused it)
        ("a@\u00b2", ("a@\u00b2", None)),
    ],
)
def test_parse_selector(selector: str, parsed: tuple[str, tuple[int, ...] | None]) -> None:
    assert parse_selector(selector) == parsed


def three_ranks() -> Timeline:
    sim = Sim(3)
    for r in range(3):
        sim.call(r, "setup")
    sim.call(1, "setup")
    sim.mark(2, "only_two")
    return sim.timeline()


def test_selectors_pick_ranks() -> None:
    tl = three_ranks()
    assert [s.rank for s in tl.spans("setup")] == [0, 1, 1, 2]
    assert [s.rank for s in tl._select("setup@0")[2]] == [0]
    assert [s.rank for s in tl._select("setup@0,2")[2]] == [0, 2]
    assert tl.happens_before("setup@0", "only_two@2") is False


def test_a_rank_named_in_a_selector_must_have_the_event() -> None:
    """``"setup@0,2"`` with no setup on rank 2 proves nothing about rank 2: refused, as
    ``"setup@2"`` alone is, never passed on the ranks that remain."""
    sim = Sim(3)
    sim.mark(0, "prepare_data")
    sim.coll("barrier")
    for r in (0, 1):
        sim.mark(r, "setup")
    tl = sim.timeline()
    tl.assert_happens_before("prepare_data@0", "setup@0,1")  # silent: both named ranks have it
    with pytest.raises(TimelineAssertionError, match="'setup@0,2': no 'setup' was recorded on rank 2\n"):
        tl.assert_happens_before("prepare_data@0", "setup@0,2")
    with pytest.raises(TimelineAssertionError, match="no 'prepare_data' was recorded on rank 2\n"):
        tl.assert_happens_before("prepare_data@0,2", "setup")
    assert tl.happens_before("prepare_data@0", "setup@0,1") is True
    assert tl.happens_before("prepare_data@0", "setup@0,2") is False


# -- assert_order -----------------------------------------------------------------------------


def ordered() -> Timeline:
    sim = Sim(2)
    for name in ("load", "setup", "noise", "train", "save"):
        sim.call(0, name)
    for name in ("setup", "load", "train"):
        sim.call(1, name)
    return sim.timeline()


def test_assert_order_accepts_a_subsequence_on_one_rank() -> None:
    tl = ordered()
    tl.assert_order(["load", "setup", "train", "save"], rank=0)
    tl.assert_order(["setup", "save"], rank=0)
    tl.assert_order("train", rank=1)
    tl.assert_order(["setup", "train"])  # every rank


def test_assert_order_reports_where_each_rank_went_wrong() -> None:
    tl = ordered()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_order(["load", "setup", "train"])
    assert message(err) == (
        "order load -> setup -> train not found:\n"
        "  rank 1: load at event #2, then no setup after it (setup at event #0)"
    )


def test_assert_order_reports_a_name_that_never_happened() -> None:
    tl = ordered()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_order(["save", "exit"], rank=0)
    assert (
        message(err)
        == "order save -> exit not found:\n  rank 0: save at event #8, then no exit after it (exit never happened)"
    )
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_order(["save"], rank=1)
    assert message(err) == "order save not found:\n  rank 1: save never happened"
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_order(["setup", "save"])
    assert message(err).splitlines()[1:] == ["  rank 1: setup at event #0, then no save after it (save never happened)"]


def test_assert_order_sees_collectives_and_marks() -> None:
    sim = Sim(2)
    sim.mark(0, "ready")
    sim.coll("all_reduce", reduce_op="SUM")
    sim.call(0, "step")
    tl = sim.timeline()
    tl.assert_order(["ready", "dist.all_reduce", "step"], rank=0)
    with pytest.raises(TimelineAssertionError):
        tl.assert_order(["step", "dist.all_reduce"], rank=0)


# -- assert_called_once -----------------------------------------------------------------------


def test_assert_called_once_passes_on_each_rank_where_it_happens() -> None:
    tl = three_ranks()
    tl.assert_called_once("setup@0")
    tl.assert_called_once("setup@0,2")
    tl.assert_called_once("only_two")


def test_assert_called_once_reports_counts_and_events() -> None:
    tl = three_ranks()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_called_once("setup")
    assert message(err) == "'setup' was called 2 times on rank 1 (events #0, #2); expected exactly once"
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_called_once("setup@1,2")
    assert message(err) == "'setup' was called 2 times on rank 1 (events #0, #2); expected exactly once"


def test_assert_called_once_reports_never() -> None:
    tl = three_ranks()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_called_once("teardown")
    assert message(err) == "'teardown' was never called on any rank"
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_called_once("only_two@0,1")
    assert message(err) == "'only_two@0,1' was never called on ranks 0,1"


def test_assert_called_once_with_explicit_ranks_requires_each_of_them() -> None:
    tl = three_ranks()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_called_once("only_two@0,2")
    assert message(err) == "'only_two' was never called on rank 0; expected exactly once"


def test_the_failure_draws_the_swimlanes() -> None:
    with pytest.raises(TimelineAssertionError) as err:
        three_ranks().assert_called_once("setup")
    lanes = str(err.value).split("\n\n", 1)[1]
    assert lanes.splitlines()[0].split(" | ")[0].strip() == "rank 0"
    assert "> setup" in lanes


# -- collective mismatches --------------------------------------------------------------------


def mismatched(rank0: dict, rank1: dict, *, before: int = 2) -> Timeline:
    sim = Sim(2)
    for _ in range(before):
        sim.coll("all_reduce", reduce_op="SUM")
    a = sim.cstart(0, **rank0)
    b = sim.cstart(1, **rank1)
    sim.cend(a)
    sim.cend(b)
    return sim.timeline()


def test_the_first_mismatch_is_reported_in_words() -> None:
    tl = mismatched({"op": "all_reduce", "reduce_op": "SUM"}, {"op": "broadcast", "root": 0})
    found = tl.collective_mismatches()
    assert len(found) == 1
    assert isinstance(found[0], Mismatch)
    assert (found[0].group, found[0].seq) == ("default", 3)
    assert str(found[0]) == (
        "collective #3 on the default group: rank 0 all_reduce(float32[4]), rank 1 broadcast(float32[4], src=0)"
    )
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_collectives_match()
    assert message(err) == str(found[0])


@pytest.mark.parametrize(
    ("rank0", "rank1", "text"),
    [
        (
            {"op": "all_reduce", "payload": "float32[4]", "reduce_op": "SUM"},
            {"op": "all_reduce", "payload": "float32[8]", "reduce_op": "SUM"},
            "rank 0 all_reduce(float32[4]), rank 1 all_reduce(float32[8])",
        ),
        (
            {"op": "all_reduce", "payload": "float32[4]", "reduce_op": "SUM"},
            {"op": "all_reduce", "payload": "float64[4]", "reduce_op": "SUM"},
            "rank 0 all_reduce(float32[4]), rank 1 all_reduce(float64[4])",
        ),
        (
            {"op": "all_reduce", "reduce_op": "SUM"},
            {"op": "all_reduce", "reduce_op": "MAX"},
            "rank 0 all_reduce(float32[4]), rank 1 all_reduce(float32[4], op=MAX)",
        ),
        (
            {"op": "broadcast", "root": 0},
            {"op": "broadcast", "root": 1},
            "rank 0 broadcast(float32[4], src=0), rank 1 broadcast(float32[4], src=1)",
        ),
        (
            {"op": "reduce", "root": 1, "reduce_op": "SUM"},
            {"op": "gather", "root": 1},
            "rank 0 reduce(float32[4], dst=1), rank 1 gather(float32[4], dst=1)",
        ),
        (
            {"op": "all_to_all_single", "payload": "float32[3]"},
            {"op": "all_to_all_single", "payload": "int64[3]"},
            "rank 0 all_to_all_single(float32[3]), rank 1 all_to_all_single(int64[3])",
        ),
        (
            {"op": "barrier", "payload": None},
            {"op": "all_gather_object", "payload": "object"},
            "rank 0 barrier(), rank 1 all_gather_object(object)",
        ),
        (
            # on gloo every member's input is the same size (NCCL takes a list all-gather uneven)
            {"op": "all_gather", "payload": "float32[2]", "even": True},
            {"op": "all_gather", "payload": "float32[3]", "even": True},
            "rank 0 all_gather(float32[2]), rank 1 all_gather(float32[3])",
        ),
    ],
    ids=["shape", "dtype", "reduce-op", "root", "op", "uneven-op-dtype", "object", "gloo-all-gather-count"],
)
def test_mismatch_kinds(rank0: dict, rank1: dict, text: str) -> None:
    (found,) = mismatched(rank0, rank1).collective_mismatches()
    assert str(found) == f"collective #3 on the default group: {text}"


@pytest.mark.parametrize(
    ("op", "payload0", "payload1"),
    [
        ("all_to_all_single", "float32[3]", "float32[5]"),
        ("all_to_all_single", "float32[3,2]", "float32[7,2]"),
        ("all_to_all", "[float32[1], float32[3]]", "[float32[2] x2]"),
        ("all_gather", "float32[2]", "float32[5]"),
        ("reduce_scatter", "float32[2]", "float32[3]"),
    ],
)
def test_uneven_splits_are_not_a_mismatch(op: str, payload0: str, payload1: str) -> None:
    tl = mismatched({"op": op, "payload": payload0}, {"op": op, "payload": payload1})
    assert tl.collective_mismatches() == []
    tl.assert_collectives_match()
    # and the collective still synchronises
    assert tl.instances[("c", "default", 3)].edges()


def test_only_the_first_mismatch_per_group_is_reported_and_groups_are_separate() -> None:
    sim = Sim(3)
    for op0, op1 in [("all_reduce", "all_reduce"), ("all_reduce", "barrier"), ("barrier", "all_reduce")]:
        a = sim.cstart(0, op0)
        b = sim.cstart(1, op1)
        c = sim.cstart(2, op0)
        for h in (a, b, c):
            sim.cend(h)
    a = sim.cstart(0, "broadcast", group="5", ranks=[0, 2], root=0)
    b = sim.cstart(2, "broadcast", group="5", ranks=[0, 2], root=2)
    sim.cend(a)
    sim.cend(b)
    found = sim.timeline().collective_mismatches()
    assert [str(m) for m in found] == [
        "collective #1 on group 5 (ranks 0,2): rank 0 broadcast(float32[4], src=0),"
        " rank 2 broadcast(float32[4], src=2)",
        "collective #2 on the default group: rank 0 all_reduce(float32[4]), rank 1 barrier(),"
        " rank 2 all_reduce(float32[4])",
    ]


def test_a_member_that_never_entered_a_mismatched_collective_is_named() -> None:
    sim = Sim(3)
    a = sim.cstart(0, "all_reduce", reduce_op="SUM")
    b = sim.cstart(1, "barrier", payload=None)
    sim.cend(a)
    sim.cend(b)
    (found,) = sim.timeline().collective_mismatches()
    assert str(found) == (
        "collective #1 on the default group: rank 0 all_reduce(float32[4]), rank 1 barrier(), rank 2 never entered it"
    )


def test_no_mismatch_when_all_match() -> None:
    sim = Sim(3)
    sim.coll("all_reduce", reduce_op="SUM")
    sim.coll("broadcast", root=2)
    sim.coll("barrier", payload=None)
    sim.coll("all_reduce", [0, 1], group="g", reduce_op="MAX")
    hs = [sim.cstart(r, "barrier", payload=None) for r in (0, 1)]  # incomplete is a hang, not a mismatch
    for h in hs:
        sim.cend(h)
    tl = sim.timeline()
    assert tl.collective_mismatches() == []
    tl.assert_collectives_match()


# -- mistakes in what is asked ------------------------------------------------------------------


def two_ranks() -> Timeline:
    sim = Sim(2)
    for r in range(2):
        sim.call(r, "setup")
    sim.barrier_all()
    for r in range(2):
        sim.call(r, "train")
    return sim.timeline()


@pytest.mark.parametrize("selector", ["setup@", "setup@x", "setup@-1", "setup@0,", "setup@0,,1"])
def test_a_malformed_rank_list_is_said_to_be_read_as_a_name(selector: str) -> None:
    with pytest.raises(TimelineAssertionError) as err:
        two_ranks().assert_happens_before(selector, "train")
    assert f"({selector!r} is read as one event name: after '@' come rank numbers, as in 'setup@0' or" in message(err)


def test_a_rank_the_timeline_does_not_have_is_named_as_such() -> None:
    tl = two_ranks()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("setup@7", "train")
    assert message(err).endswith("no 'setup' was recorded on rank 7 (this timeline has ranks 0,1; no rank 7)")
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_order(["setup", "train"], rank=7)
    assert message(err) == "order setup -> train: no rank 7 in this timeline (it has ranks 0,1)"
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_called_once("setup@5")
    assert "(this timeline has ranks 0,1; no rank 5)" in message(err)


def test_a_name_that_really_holds_an_at_sign_is_found_without_a_hint() -> None:
    sim = Sim(1)
    sim.call(0, "user@host")
    sim.call(0, "after")
    tl = sim.timeline()
    tl.assert_happens_before("user@host", "after")
    tl.assert_called_once("user@host")


def test_an_event_given_as_a_list_is_a_type_error_that_says_so() -> None:
    tl = two_ranks()
    with pytest.raises(TypeError, match=r"an event is named by a str \('setup', 'setup@0', 'setup@0,2'\), got list"):
        tl.assert_happens_before(["setup"], "train")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="assert_order takes event names"):
        tl.assert_order(["setup", 3])  # type: ignore[list-item]


def test_events_on_two_threads_of_one_rank_are_said_to_be_unordered_threads() -> None:
    sim = Sim(1)
    sim.call(0, "produce", lane=1)
    sim.call(0, "consume", lane=0)
    with pytest.raises(TimelineAssertionError) as err:
        sim.timeline().assert_happens_before("produce", "consume")
    text = message(err)
    assert "on different threads of rank 0 (lane 1, lane 0): what orders threads of one process" in text
    assert "took part in no collective" not in text


def test_an_event_whose_name_ends_like_a_rank_list_is_said_how_to_select() -> None:
    sim = Sim(2)
    for r in range(2):
        sim.mark(r, "epoch@1")
    sim.barrier_all()
    for r in range(2):
        sim.call(r, "train")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("epoch@1", "train")
    assert message(err).endswith(
        "no 'epoch' was recorded on rank 1 (an event named 'epoch@1' was recorded: the last '@' starts the ranks,"
        " so it is selected as 'epoch@1@0', 'epoch@1@0,1', ...)"
    )
    tl.assert_happens_before("epoch@1@0,1", "train")


def test_an_event_asked_to_happen_before_itself_is_said_so() -> None:
    with pytest.raises(TimelineAssertionError) as err:
        two_ranks().assert_happens_before("setup@0", "setup@0")
    assert "setup on rank 0 (event #0) is both: nothing happens before itself" in message(err)


def test_a_collective_entered_in_different_hooks_is_pointed_out() -> None:
    sim = Sim(2)
    sim.coll("barrier")  # entered outside any hook: says nothing
    with sim.span(0, "Model.setup"):
        a = sim.cstart(0, "barrier")
    with sim.span(1, "DDPStrategy.barrier", events.BARRIER):
        b = sim.cstart(1, "barrier")
    sim.cend(a)
    sim.cend(b)
    assert sim.timeline().entered_in_different_hooks() == (
        "barrier #2 on the default group was entered in different hooks (rank 0 in Model.setup, rank 1 in"
        " DDPStrategy.barrier): gloo takes any two barrier calls of one shape as one, so these may be two"
        " different ones, paired"
    )


def test_calls_that_do_not_match_are_a_desync_not_a_pairing_across_hooks() -> None:
    sim = Sim(2)
    with sim.span(0, "Trainer.setup"):
        a = sim.cstart(0, "barrier")
    with sim.span(1, "Trainer.step"):
        b = sim.cstart(1, "all_reduce", payload="float32[3]")
    sim.cend(a)
    sim.cend(b)
    tl = sim.timeline()
    assert tl.collective_mismatches(), "a desync"
    assert tl.entered_in_different_hooks() is None


def test_a_collective_entered_in_the_same_hook_is_not_pointed_out() -> None:
    sim = Sim(2)
    handles = {}
    for r in range(2):
        with sim.span(r, "Trainer.fit"):
            handles[r] = sim.cstart(r, "barrier")
    for h in handles.values():
        sim.cend(h)
    assert sim.timeline().entered_in_different_hooks() is None


def test_a_rank_argument_must_be_a_rank_of_the_timeline() -> None:
    sim = Sim(2)
    for rank, name in enumerate("ab"):
        sim.mark(rank, name)
    tl = sim.timeline()
    with pytest.raises(TypeError, match=r"assert_order: a rank is an int, got str '0'"):
        tl.assert_order(["a"], rank="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"for_rank: a rank is an int, got str '1'"):
        tl.for_rank("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"for_rank\(7\): no rank 7 in this timeline \(it has ranks 0,1\)"):
        tl.for_rank(7)
    assert [e.name for e in tl.for_rank(1)] == ["b"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_rows": 0}, "max_rows=0"),
        ({"max_rows": -1}, "max_rows=-1"),
        ({"width": 0}, "width=0"),
        ({"width": -5}, "width=-5"),
        ({"width": "wide"}, "width='wide'"),
    ],
)
def test_swimlanes_refuse_sizes_that_draw_nothing(arguments: dict, message: str) -> None:
    sim = Sim(2)
    sim.mark(0, "a")
    with pytest.raises(ValueError, match=rf"swimlanes\({message}\): .* is an int of at least \d+, or None"):
        sim.timeline().swimlanes(**arguments)


def test_swimlanes_keep_the_last_rows_they_are_given() -> None:
    sim = Sim(1)
    for name in ("one", "two", "three"):
        sim.mark(0, name)
    lanes = sim.timeline().swimlanes(max_rows=1).splitlines()
    assert lanes[2:] == ["... 2 rows not shown ...", "* three"]


def test_a_failed_assertion_shows_the_rows_around_its_events() -> None:
    """The excerpt was the first and last 30 rows: in a loop of 200 steps, the two events at
    fault and the collectives around them were in the rows left out."""
    sim = Sim(2)
    for i in range(200):
        sim.coll("all_reduce")
        if i == 100:
            sim.mark(0, "a")
            sim.mark(1, "b")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as raised:
        tl.assert_happens_before("a@0", "b@1")
    lanes = str(raised.value).split("\n\n", 1)[1].splitlines()
    shown = [line for line in lanes[2:] if not line.startswith("...")]
    assert len(shown) <= 61
    assert any(line.startswith("* a") and line.rstrip().endswith("* b") for line in shown)
    assert "all_reduce #101" in "\n".join(shown) and "all_reduce #102" in "\n".join(shown)
    assert lanes[2].startswith("... ") and lanes[-1].startswith("... ")
    # one that passes shows what it is asked for, as before
    assert "... " in tl.swimlanes(max_rows=60) and "* a" not in tl.swimlanes(max_rows=60)


@pytest.mark.parametrize("noops", [1, 600])
def test_a_noop_barrier_is_shown_in_the_rows_around_it(noops: int) -> None:
    sim = Sim(2)
    for i in range(100):
        sim.coll("all_reduce")
        if i == 50:
            for _ in range(noops):
                sim.barrier_all(collective=False)
    with pytest.raises(TimelineAssertionError) as raised:
        sim.timeline().assert_no_noop_barriers()
    lanes = str(raised.value).split("\n\n", 1)[1].splitlines()[2:]
    assert "(no-op)" in "\n".join(lanes)
    # around the first ones when there are many: about 60 rows, with what is left out said between
    assert len([line for line in lanes if not line.startswith("...")]) <= 60 and len(lanes) <= 80
