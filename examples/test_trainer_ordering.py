"""Copy me: prove your trainer's hook order on real ranks with pytest-ddphooks.

Replace the reference trainer by your own; keep the shape. Run: ``pytest examples/``.
"""

import pytest

from reference_trainer import RegressionDataModule, RegressionModule, Trainer, instrument_trainer


# 1. The ranks are started the way torchrun would start them (variables, no group): the
#    trainer must create its process group itself, BEFORE prepare_data. nodes=2 simulates two
#    machines: LOCAL_RANK 0,1,0,1 and a node_tmp_path of their own.
@pytest.mark.multirank(world_size=4, nodes=2, init_process_group=False)
def test_prepare_data_is_done_before_anyone_sets_up(rank, recorder, shared_tmp_path):
    trainer = Trainer("ddp", prepare_data_per_node=True)
    module, data = RegressionModule(), RegressionDataModule(shared_tmp_path)

    # 2. Record the hooks, the strategy's barrier (a barrier that issues no collective is a
    #    "no-op barrier") and model_to_device. torch.distributed calls are recorded anyway.
    instrument_trainer(recorder, trainer, module, data)
    trainer.fit(module, data)

    # 3. One timeline of every rank; the same on each. Happens-before comes from the
    #    collectives between the events, never from their timestamps: a missing barrier fails
    #    here even on a machine fast enough that the data was always there in time.
    timeline = recorder.timeline()
    timeline.assert_happens_before("dm.prepare_data@0,2", "dm.setup")  # local rank 0 of each node
    timeline.assert_happens_before("setup", "configure_model")
    timeline.assert_called_once("model_to_device")
    timeline.assert_no_noop_barriers()
    timeline.assert_collectives_match()


# 4. A seeded bug from the history of this problem: the group is created after prepare_data,
#    so the barrier before setup has no group and returns at once. The plugin must say so.
@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_the_historic_bug_is_caught(rank, recorder, shared_tmp_path):
    RegressionDataModule(shared_tmp_path).prepare_data()  # data left by an earlier run: no crash
    trainer = Trainer("ddp", bugs={"group_after_prepare_data"}, prepare_data_per_node=False)
    module, data = RegressionModule(), RegressionDataModule(shared_tmp_path)
    instrument_trainer(recorder, trainer, module, data)
    trainer.fit(module, data)
    timeline = recorder.timeline()

    with pytest.raises(AssertionError, match="no collective connects them"):
        timeline.assert_happens_before("dm.prepare_data@0", "dm.setup")
    noop_on_rank1 = [b for b in timeline.noop_barriers() if b.rank == 1]
    assert noop_on_rank1 and noop_on_rank1[0].reason.endswith("no process group existed")
