"""The reference trainer trains for real, on each strategy, and keeps DDP ranks in step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from pytest_ddphooks import Recorder, TimelineAssertionError
from reference_trainer import (
    LIFECYCLE,
    FitResult,
    ParamSyncCheck,
    RegressionDataModule,
    RegressionModule,
    Trainer,
    instrument_trainer,
)


def fit(strategy: str, data_dir: os.PathLike[str], **kwargs: object) -> FitResult:
    epochs = kwargs.pop("max_epochs", 2)
    trainer = Trainer(strategy, max_epochs=epochs, timeout=60.0, **kwargs)  # type: ignore[arg-type]
    return trainer.fit(RegressionModule(), RegressionDataModule(data_dir))


def assert_trained(result: FitResult) -> None:
    assert len(result.losses) >= 8
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert result.final_loss < 0.5 * result.initial_loss, result.losses


def test_single_fit_lowers_the_loss(tmp_path) -> None:
    result = fit("single", tmp_path, max_epochs=3, record=True)
    assert_trained(result)
    assert result.world_size == 1 and list(result.ranks) == [0]
    assert not dist.is_initialized()
    timeline = result.timeline
    assert timeline is not None
    timeline.assert_order(["dm.prepare_data", "prepare_data", *LIFECYCLE[1:]])
    timeline.assert_called_once("model_to_device")
    # one process has no group: both barriers are no-ops, by design
    assert [nb.name for nb in timeline.noop_barriers()] == ["barrier", "barrier"]


def test_single_fit_is_deterministic(tmp_path) -> None:
    a = fit("single", tmp_path / "a", max_epochs=1, seed=3)
    b = fit("single", tmp_path / "b", max_epochs=1, seed=3)
    assert a.losses == b.losses
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


@pytest.fixture(scope="module")
def ddp_result(tmp_path_factory) -> FitResult:
    return fit(
        "ddp", tmp_path_factory.mktemp("ddp"), world_size=2, max_epochs=2, callbacks=[ParamSyncCheck()], record=True
    )


def test_ddp_trains_on_two_launched_ranks(ddp_result: FitResult) -> None:
    assert_trained(ddp_result)
    assert sorted(ddp_result.ranks) == [0, 1]
    assert {r: out.rank_info["global_rank"] for r, out in ddp_result.ranks.items()} == {0: 0, 1: 1}
    # 256 samples, 2 ranks, batch 16: 8 steps per epoch on each rank
    assert [len(out.losses) for out in ddp_result.ranks.values()] == [16, 16]
    assert ddp_result.ranks[0].losses != ddp_result.ranks[1].losses  # each rank its own slice


def test_ddp_parameters_are_identical_on_every_rank_after_every_step(ddp_result: FitResult) -> None:
    for rank, out in ddp_result.ranks.items():
        flags = out.metrics["param_sync"]
        assert len(flags) == len(out.losses) == 16, rank
        assert all(flags), f"rank {rank}: parameters differed after steps {[i for i, ok in enumerate(flags) if not ok]}"
    first, second = ddp_result.ranks[0].params, ddp_result.ranks[1].params
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_ddp_timeline_follows_the_documented_order(ddp_result: FitResult) -> None:
    timeline = ddp_result.timeline
    assert timeline is not None and timeline.ranks == [0, 1]
    timeline.assert_order(LIFECYCLE)
    timeline.assert_order(["strategy.setup_environment", "dist.init_process_group", "dm.prepare_data"], rank=0)
    timeline.assert_happens_before("dm.prepare_data@0", "dm.setup")
    timeline.assert_happens_before("setup", "configure_model")
    timeline.assert_called_once("model_to_device")
    timeline.assert_called_once("dist.init_process_group")
    timeline.assert_called_once("dist.destroy_process_group")
    timeline.assert_no_noop_barriers()
    timeline.assert_collectives_match()
    assert not timeline.spans("dm.prepare_data", ranks=[1])  # once per node: local rank 0 only


def test_fsdp_trains_and_matches_ddp(tmp_path, ddp_result: FitResult) -> None:
    result = fit("fsdp", tmp_path, world_size=2, max_epochs=2)
    assert_trained(result)
    # parameters come back as dim-0 shards and are put back together
    assert result.ranks[0].sharded and result.ranks[0].sharded == result.ranks[1].sharded
    full, reference = result.state_dict(), ddp_result.state_dict()
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in reference.items()}
    # the same data, seed and averaged gradients: FSDP and DDP take the same steps
    for name in reference:
        torch.testing.assert_close(full[name], reference[name], rtol=1e-4, atol=1e-5)


def test_ddp_spawn_trains_and_prepares_data_in_the_launcher(tmp_path) -> None:
    result = fit("ddp_spawn", tmp_path, world_size=2, max_epochs=2, record=True)
    assert_trained(result)
    timeline = result.timeline
    assert timeline is not None
    # the documented difference: prepare_data ran before rank 0's process set anything up
    timeline.assert_order(["dm.prepare_data", "prepare_data", "strategy.setup_environment", "dm.setup"], rank=0)
    assert not timeline.spans("dm.prepare_data", ranks=[1])
    timeline.assert_order(LIFECYCLE)
    timeline.assert_happens_before("dm.prepare_data@0", "dm.setup")
    timeline.assert_no_noop_barriers()


def test_two_nodes_prepare_once_per_node_or_once(tmp_path) -> None:
    per_node = fit("ddp", tmp_path / "a", world_size=2, num_nodes=2, max_epochs=1, record=True)
    assert per_node.timeline is not None
    assert {s.rank for s in per_node.timeline.spans("dm.prepare_data")} == {0, 1}
    assert per_node.ranks[1].rank_info == {
        "global_rank": 1, "local_rank": 0, "node_rank": 1, "world_size": 2, "local_world_size": 1, "num_nodes": 2
    }  # fmt: skip
    shared = fit(
        "ddp", tmp_path / "b", world_size=2, num_nodes=2, max_epochs=1, record=True, prepare_data_per_node=False
    )
    assert shared.timeline is not None
    assert {s.rank for s in shared.timeline.spans("dm.prepare_data")} == {0}
    shared.timeline.assert_happens_before("dm.prepare_data@0", "dm.setup@1")


def test_default_data_folder_is_removed_at_teardown() -> None:
    dm = RegressionDataModule()
    Trainer("single").fit(RegressionModule(), dm)
    assert not os.path.exists(dm.data_dir)


def test_instrument_trainer_in_process(tmp_path) -> None:
    trainer = Trainer("single")
    module, dm = RegressionModule(), RegressionDataModule(tmp_path)
    with Recorder(rank=0, world_size=1) as rec:
        instrument_trainer(rec, trainer, module, dm)
        trainer.fit(module, dm)
        timeline = rec.timeline()
    timeline.assert_order(["dm.prepare_data", "barrier", "dm.setup", "model_to_device", "wrap_model"])
    with pytest.raises(TimelineAssertionError, match="no-op barrier"):
        timeline.assert_no_noop_barriers()


def test_self_launch_refuses_a_caller_side_recorder(tmp_path) -> None:
    trainer = Trainer("ddp", world_size=2)
    module, dm = RegressionModule(), RegressionDataModule(tmp_path)
    with Recorder(rank=0, world_size=1) as rec:
        instrument_trainer(rec, trainer, module, dm)
        with pytest.raises(ValueError, match="record=True"):
            trainer.fit(module, dm)


def test_checkpoint_arguments_that_cannot_work_are_refused() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with pytest.raises(ValueError, match=r"^resume=True needs checkpoint_dir: the folder to resume from$"):
        Trainer("single", resume=True)
    with pytest.raises(ValueError, match=r"^ddp_comm_hook: strategy 'fsdp' does not wrap the model in DDP$"):
        Trainer("fsdp", ddp_comm_hook=allreduce_hook)
    with pytest.raises(ValueError, match=r"^ddp_comm_hook: strategy 'single' does not wrap the model in DDP$"):
        Trainer("single", ddp_comm_hook=allreduce_hook)


def test_a_single_fit_resumed_from_its_checkpoint_ends_like_an_uninterrupted_one(tmp_path) -> None:
    def params(result: FitResult) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in result.first.params.values()])

    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    whole = Trainer("single", max_epochs=3).fit(RegressionModule(), RegressionDataModule(data))
    Trainer("single", max_epochs=2, checkpoint_dir=ckpt).fit(RegressionModule(), RegressionDataModule(data))
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch-0000.pt", "epoch-0001.pt"]
    resumed_trainer = Trainer("single", max_epochs=3, checkpoint_dir=ckpt, resume=True)
    resumed = resumed_trainer.fit(RegressionModule(), RegressionDataModule(data))
    assert resumed_trainer.resumed_from == 1 and len(resumed.losses) == len(whole.losses) // 3
    assert torch.equal(params(resumed), params(whole))
