"""Each seeded bug changes the trainer in the one way it says, on two launched ranks."""

from __future__ import annotations

import tempfile

import pytest

from pytest_ddphooks import Timeline, TimelineAssertionError
from reference_trainer import RankError, RegressionDataModule, RegressionModule, Trainer


def timeline_of(tmp_path, *bugs: str, **kwargs: object) -> Timeline:
    trainer = Trainer("ddp", world_size=2, record=True, bugs=bugs, timeout=60.0, **kwargs)  # type: ignore[arg-type]
    result = trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))
    assert result.timeline is not None
    return result.timeline


def cached(tmp_path) -> dict[str, object]:
    """Data already on the shared disk, as after an earlier run: setup then finds it even when
    nothing orders it after prepare_data, and only the timeline shows the bug."""
    RegressionDataModule(tmp_path).prepare_data()
    return {"prepare_data_per_node": False}


def barriers(timeline: Timeline, rank: int) -> int:
    return len(timeline.spans("barrier", ranks=[rank]))


def test_unknown_bug_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown bug"):
        Trainer("single", bugs={"no_such_bug"})


@pytest.mark.parametrize("bug", ["group_after_prepare_data", "no_barrier_before_setup"])
def test_unordered_prepare_data_lets_setup_find_no_file(tmp_path, bug: str) -> None:
    # a "download" of a second: rank 1 is in setup long before rank 0 has written anything
    trainer = Trainer("ddp", world_size=2, bugs={bug}, timeout=60.0)
    with pytest.raises(RankError, match="found no data") as caught:
        trainer.fit(RegressionModule(), RegressionDataModule(tmp_path, slow_prepare=1.0))
    assert caught.value.rank == 1


def test_group_after_prepare_data_shows_a_noop_barrier(tmp_path) -> None:
    timeline = timeline_of(tmp_path, "group_after_prepare_data", **cached(tmp_path))
    assert {nb.rank for nb in timeline.noop_barriers()} == {0, 1}
    with pytest.raises(TimelineAssertionError, match="does not happen before"):
        timeline.assert_happens_before("dm.prepare_data@0", "dm.setup@1")
    timeline.assert_order(["barrier", "dm.setup", "dist.init_process_group", "barrier", "configure_model"])


def test_no_barrier_before_setup_breaks_the_order_between_ranks(tmp_path) -> None:
    timeline = timeline_of(tmp_path, "no_barrier_before_setup", **cached(tmp_path))
    assert barriers(timeline, 0) == barriers(timeline, 1) == 1
    with pytest.raises(TimelineAssertionError):
        timeline.assert_happens_before("dm.prepare_data@0", "dm.setup@1")


def test_no_barrier_after_setup(tmp_path) -> None:
    timeline = timeline_of(tmp_path, "no_barrier_after_setup")
    assert barriers(timeline, 0) == barriers(timeline, 1) == 1
    timeline.assert_happens_before("dm.prepare_data@0", "dm.setup@1")
    with pytest.raises(TimelineAssertionError):
        timeline.assert_happens_before("setup@0", "configure_model@1")


def test_prepare_data_every_rank(tmp_path) -> None:
    timeline = timeline_of(tmp_path, "prepare_data_every_rank")
    assert {s.rank for s in timeline.spans("dm.prepare_data")} == {0, 1}


def test_prepare_data_rank0_only_starves_the_second_node(tmp_path, monkeypatch) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    trainer = Trainer("ddp", world_size=2, num_nodes=2, bugs={"prepare_data_rank0_only"}, timeout=60.0)
    with pytest.raises(RankError, match="found no data") as caught:
        trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))
    assert caught.value.rank == 1
    # torch.multiprocessing leaves the traceback file of a child that raised; the launcher removes it
    assert list(temp.iterdir()) == []


def test_model_to_device_twice(tmp_path) -> None:
    timeline = timeline_of(tmp_path, "model_to_device_twice")
    with pytest.raises(TimelineAssertionError, match="called 2 times"):
        timeline.assert_called_once("model_to_device")


def test_barrier_rank0_only_hangs_until_the_group_timeout(tmp_path) -> None:
    trainer = Trainer("ddp", world_size=2, bugs={"barrier_rank0_only"}, timeout=3.0)
    with pytest.raises(RankError):
        trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))


def test_teardown_keeps_group(tmp_path) -> None:
    timeline = timeline_of(tmp_path, "teardown_keeps_group")
    timeline.assert_called_once("strategy.teardown")
    assert not timeline.spans("dist.destroy_process_group")
