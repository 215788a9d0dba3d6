"""A rank's own garbage collections leave the fork server's objects alone (they are frozen as
the rank starts), yet everything a test can ask the collector answers as in a fresh process."""

from __future__ import annotations

INHERITED = """
import gc
import pickle
import weakref

import pytest

from pytest_ddphooks.launch import inherited_heap


class Node:
    pass


# made as the module was imported, before the fork server forked the ranks
KEPT = Node()
# in a dict: an in-process pytester session keeps the objects collection saw by name
HELD = {"cycle": Node()}
HELD["cycle"].me = HELD["cycle"]
CYCLE_REF = weakref.ref(HELD["cycle"])
"""


def test_inherited_objects_are_frozen_yet_every_question_to_gc_sees_them(inner) -> None:
    ran = inner(
        INHERITED
        + """
@pytest.mark.multirank(world_size=2)
def test_frozen_then_given_back(rank):
    # the rank's own collections skip what it inherited: it is in the permanent generation
    assert inherited_heap._original["get_freeze_count"]() > 100_000
    assert gc.get_freeze_count() == 0  # as in a process that froze nothing
    assert any(o is KEPT for o in gc.get_objects())  # puts them back first
    assert inherited_heap._original["get_freeze_count"]() == 0
    assert globals() in gc.get_referrers(KEPT)
    # named as the functions they stand for: found, and pickled, by that name
    assert pickle.loads(pickle.dumps(gc.collect)) is gc.collect and gc.collect.__name__ == "collect"


@pytest.mark.multirank(world_size=2)
def test_an_inherited_cycle_let_go_is_collected_on_request(rank):
    assert gc.get_freeze_count() == 0
    HELD["cycle"] = None
    gc.collect(1)  # a young collection does not reach what was inherited
    assert CYCLE_REF() is not None
    gc.collect()
    assert CYCLE_REF() is None


@pytest.mark.multirank(world_size=2)
def test_the_tests_own_freeze_acts_as_it_would(rank):
    gc.freeze()
    frozen = gc.get_freeze_count()
    assert frozen > 100_000  # everything, inherited objects included
    assert not any(o is KEPT for o in gc.get_objects())  # frozen, as the test asked
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert any(o is KEPT for o in gc.get_objects())
"""
    )
    ran.result.assert_outcomes(passed=3)


def test_turned_off_by_the_option(inner) -> None:
    ran = inner(
        INHERITED
        + """
@pytest.mark.multirank(world_size=2)
def test_nothing_frozen(rank):
    assert not inherited_heap._original and not inherited_heap._ours
    assert gc.get_freeze_count() == 0
""",
        "--ddp-freeze-inherited=off",
    )
    ran.result.assert_outcomes(passed=1)


def test_a_freeze_made_before_the_fork_is_left_as_it_is(inner) -> None:
    ran = inner(
        INHERITED
        + """
gc.freeze()  # as the module is imported: before the fork server starts


@pytest.mark.multirank(world_size=2)
def test_nothing_done(rank):
    assert not inherited_heap._ours
    assert gc.get_freeze_count() > 1000  # the module's, reported as it is
    assert not any(o is KEPT for o in gc.get_objects())  # frozen, as the module asked
""",
        subprocess=True,  # the module's freeze would stay in this process
    )
    ran.result.assert_outcomes(passed=1)
