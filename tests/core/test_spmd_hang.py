"""What rank 0 says of a hang under torchrun, from what each rank posted (no ranks needed)."""

from __future__ import annotations

from pytest_ddphooks.recorder import collectives
from pytest_ddphooks.spmd import HangPost, desyncs, who_never_entered


def test_a_rank_behind_a_collective_others_wait_in_is_named() -> None:
    posts = {
        0: HangPost("r0", blocked=[("default", 2, "barrier", None)], entered={"default": 2}),
        1: HangPost("r1", entered={"default": 1}),
    }
    assert who_never_entered(posts, 2) == ["barrier #2 on group default: rank 0 waits in it, rank 1 never entered it"]


def test_ranks_all_inside_the_same_collective_blame_nobody() -> None:
    posts = {r: HangPost(f"r{r}", blocked=[("default", 3, "all_reduce", None)], entered={"default": 3}) for r in (0, 1)}
    assert who_never_entered(posts, 2) == []


def test_a_subgroup_blames_only_its_members_and_a_silent_rank_is_named() -> None:
    posts = {
        0: HangPost("r0", blocked=[("1", 1, "all_reduce", [0, 2])], entered={"default": 4, "1": 1}),
        1: HangPost("r1", entered={"default": 4}),  # not a member of group 1
        2: HangPost("r2", entered={"default": 4}),
    }
    assert who_never_entered(posts, 4) == [
        "all_reduce #1 on group 1: rank 0 waits in it, rank 2 never entered it",
        "rank 3 said nothing (stuck in native code that holds the GIL, or gone)",
    ]


def test_a_post_survives_the_store_and_plain_text_still_reads() -> None:
    post = HangPost("stuck at x", blocked=[("default", 2, "barrier", None)], entered={"default": 2})
    assert HangPost.loads(post.dumps()) == post
    assert HangPost.loads(b"an older rank's words").text == "an older rank's words"


def _inside(op: str, payload: str, **more: object) -> HangPost:
    """A rank's post from inside collective #3 of the default group."""
    info = {"op": op, "payload": payload, **more}
    same, call = repr(collectives.comparable(op, info)), collectives.signature(op, info)
    return HangPost("r", blocked=[("default", 3, op, None)], entered={"default": 3}, calls=[("default", 3, same, call)])


def test_hung_ranks_inside_calls_that_cannot_match_are_a_desync() -> None:
    posts = {0: _inside("all_reduce", "float32[4]", reduce_op="SUM"), 1: _inside("broadcast", "float32[4]", root=0)}
    assert [str(m) for m in desyncs(posts)] == [
        "collective #3 on the default group: rank 0 all_reduce(float32[4]), rank 1 broadcast(float32[4], src=0)"
    ]
    assert HangPost.loads(posts[0].dumps()) == posts[0]


def test_hung_ranks_inside_the_same_collective_are_no_desync() -> None:
    # a view differs, what the backend checks does not
    posts = {0: _inside("all_reduce", "float32[2,2]"), 1: _inside("all_reduce", "float32[4]"), 2: HangPost("r")}
    assert desyncs(posts) == []
