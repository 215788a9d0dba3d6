"""The reference trainer's ordering suite, on real ranks, as a user of the plugin writes it.

Every strategy x world size 1, 2, 4 x prepare_data_per_node x 1 or 2 simulated nodes, with
ranks started by the plugin as an outside launcher would (the trainer creates its group), a
few with the plugin's own group, and the trainer's self-launched ranks. The data is on disk
before the fit starts, as after an earlier run: setup always finds it, so an ordering bug
cannot announce itself by a crash. Only the timeline can tell, and it must.

``REFERENCE_TRAINER_BUGS`` (comma-separated names from ``reference_trainer.BUGS``) seeds bugs
into every fit: the mutation tests in ``test_mutants.py`` run this very file with it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from pytest_ddphooks import Timeline
from reference_trainer import Callback, RegressionDataModule, RegressionModule, Trainer, instrument_trainer
from reference_trainer.task import DATA_FILE

SEEDED = tuple(sorted(filter(None, os.environ.get("REFERENCE_TRAINER_BUGS", "").split(","))))
LIMIT = float(os.environ.get("ORDERING_TIMEOUT", "60"))  # seconds per multirank test
LAUNCHED = ["external", "ddp", "ddp_spawn", "fsdp"]
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]  # (world size, nodes)


def seed_data(root: Path, nodes: int) -> None:
    """What an earlier run's prepare_data left on every node's disk and the shared one.

    Every rank seeds, unsynchronised (a seeded bug may have removed the barrier that would order
    it), so each write goes to a private name and is renamed: a reader sees a whole file.
    """
    x, y = RegressionDataModule(root).make()
    for folder in [*(f"node{k}" for k in range(nodes)), "shared"]:
        (root / folder).mkdir(parents=True, exist_ok=True)
        tmp = root / folder / f".seed.{os.getpid()}.tmp"
        torch.save({"x": x, "y": y}, tmp)
        os.replace(tmp, root / folder / DATA_FILE)


def preparers(world_size: int, nodes: int, per_node: bool) -> list[int]:
    local = world_size // nodes
    return [r for r in range(world_size) if (r % local == 0 if per_node else r == 0)]


def check_lifecycle(timeline: Timeline, world_size: int, nodes: int, per_node: bool, *, owns_group: bool) -> None:
    """The documented order, proven from the timeline of one fit."""
    expected = preparers(world_size, nodes, per_node)
    ran = sorted({s.rank for s in timeline.spans("dm.prepare_data")})
    assert ran == expected, (
        f"prepare_data ran on ranks {ran}, expected {expected}"
        f" (prepare_data_per_node={per_node}, {nodes} node(s) of {world_size // nodes})"
    )
    where = ",".join(str(r) for r in expected)
    timeline.assert_called_once(f"dm.prepare_data@{where}")
    timeline.assert_happens_before(f"dm.prepare_data@{where}", "dm.setup")
    timeline.assert_happens_before("setup", "configure_model")
    timeline.assert_happens_before("setup", "wrap_model")
    timeline.assert_called_once("model_to_device")
    timeline.assert_order(
        [
            "strategy.setup_environment",
            "barrier",
            "dm.setup",
            "setup",
            "barrier",
            "configure_model",
            "model_to_device",
            "wrap_model",
            "configure_optimizers",
            "on_fit_start",
            "on_fit_end",
            "teardown",
            "strategy.teardown",
        ]
    )
    timeline.assert_no_noop_barriers()
    timeline.assert_collectives_match()
    if owns_group:
        # the group the trainer created is gone after its teardown, and only that one
        timeline.assert_order(["strategy.setup_environment", "dist.init_process_group"])
        timeline.assert_order(["teardown", "dist.destroy_process_group"])
        timeline.assert_called_once("dist.destroy_process_group")
    else:
        assert not timeline.spans("dist.destroy_process_group"), "the trainer destroyed a group it did not create"


def fit_in_rank(strategy: str, rank_recorder, data: Path, nodes: int, per_node: bool) -> None:
    trainer = Trainer(strategy, prepare_data_per_node=per_node, num_nodes=nodes, bugs=SEEDED, timeout=60.0)
    module, dm = RegressionModule(), RegressionDataModule(data)
    instrument_trainer(rank_recorder, trainer, module, dm)
    result = trainer.fit(module, dm)
    assert result.final_loss < result.initial_loss


def _launched_cases():
    for strategy in LAUNCHED:
        for world_size, nodes in LAYOUTS:
            for per_node in (True, False):
                mark = pytest.mark.multirank(
                    world_size=world_size, nodes=nodes, init_process_group=False, timeout=LIMIT
                )
                yield pytest.param(
                    strategy,
                    world_size,
                    nodes,
                    per_node,
                    marks=mark,
                    id=f"{strategy}-ws{world_size}-nodes{nodes}-{'per_node' if per_node else 'once'}",
                )


@pytest.mark.parametrize(("strategy", "ws", "nodes", "per_node"), list(_launched_cases()))
def test_launched_ranks(strategy, ws, nodes, per_node, rank, recorder, shared_tmp_path) -> None:
    seed_data(shared_tmp_path, nodes)
    fit_in_rank(strategy, recorder, shared_tmp_path, nodes, per_node)
    check_lifecycle(recorder.timeline(), ws, nodes, per_node, owns_group=True)


@pytest.mark.parametrize("strategy", ["external", "ddp", "fsdp"])
@pytest.mark.multirank(world_size=2, timeout=LIMIT)
def test_group_that_exists_already_is_used_and_left_alone(strategy, rank, recorder, shared_tmp_path) -> None:
    seed_data(shared_tmp_path, 1)
    fit_in_rank(strategy, recorder, shared_tmp_path, 1, True)
    check_lifecycle(recorder.timeline(), 2, 1, True, owns_group=False)


@pytest.mark.parametrize("per_node", [True, False])
def test_single_process(per_node, tmp_path) -> None:
    seed_data(tmp_path, 1)
    trainer = Trainer("single", prepare_data_per_node=per_node, bugs=SEEDED, record=True)
    result = trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))
    timeline = result.timeline
    assert timeline is not None
    assert sorted({s.rank for s in timeline.spans("dm.prepare_data")}) == [0]
    timeline.assert_called_once("model_to_device")
    timeline.assert_order(["dm.prepare_data", "barrier", "dm.setup", "barrier", "configure_model", "wrap_model"])
    # one process, no group: its barriers are no-ops by design, and say so
    assert {nb.reason for nb in timeline.noop_barriers()} == {"issued no collective: no process group existed"}


SELF_LAUNCHED = [
    pytest.param("ddp", 2, 1, True, id="ddp-ws2-nodes1-per_node"),
    pytest.param("ddp", 4, 2, True, id="ddp-ws4-nodes2-per_node"),
    pytest.param("ddp", 4, 2, False, id="ddp-ws4-nodes2-once"),
    pytest.param("fsdp", 2, 1, False, id="fsdp-ws2-nodes1-once"),
    pytest.param("fsdp", 4, 2, True, id="fsdp-ws4-nodes2-per_node"),
]


@pytest.mark.parametrize(("strategy", "ws", "nodes", "per_node"), SELF_LAUNCHED)
def test_self_launched_ranks(strategy, ws, nodes, per_node, tmp_path) -> None:
    seed_data(tmp_path, nodes)
    trainer = Trainer(
        strategy, world_size=ws, num_nodes=nodes, prepare_data_per_node=per_node, bugs=SEEDED, record=True, timeout=60.0
    )
    result = trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))
    assert result.timeline is not None and result.timeline.ranks == list(range(ws))
    check_lifecycle(result.timeline, ws, nodes, per_node, owns_group=True)


@pytest.fixture
def launched_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This pytest process as rank 0 of 1, as torchrun would start it: variables and a store."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    port = sock.getsockname()[1]
    wait = timedelta(seconds=30)
    store = [dist.TCPStore("127.0.0.1", port, 1, True, wait, wait_for_workers=False, master_listen_fd=sock.detach())]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    yield
    store.clear()


def test_in_process_fit_leaves_nothing_behind(launched_here, tmp_path) -> None:
    # the pytest process is the rank: the leak guard sees a group the trainer forgot
    seed_data(tmp_path, 1)
    trainer = Trainer("external", bugs=SEEDED, record=True, timeout=60.0)
    result = trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))
    assert result.timeline is not None
    check_lifecycle(result.timeline, 1, 1, True, owns_group=True)


# -- faults and restarts --------------------------------------------------------------------
# DDP's gradient all-reduces go through torch's Python comm hook (``allreduce_hook``), one per
# step: "dist.all_reduce#n" is the n-th training step's.

EPOCHS = 3


def steps_per_epoch(world_size: int, batch_size: int = 16) -> int:
    return RegressionDataModule().n_samples // (world_size * batch_size)


def checkpointing_fit(recorder, data: Path, **kwargs) -> tuple[Trainer, torch.Tensor]:
    trainer = Trainer("ddp", max_epochs=EPOCHS, bugs=SEEDED, timeout=60.0, ddp_comm_hook=allreduce_hook, **kwargs)
    module, dm = RegressionModule(), RegressionDataModule(data)
    if recorder is not None:
        instrument_trainer(recorder, trainer, module, dm)
    result = trainer.fit(module, dm)
    return trainer, torch.cat([p.reshape(-1) for p in result.first.params.values()])


@pytest.mark.multirank(world_size=2, restarts=1, timeout=LIMIT)
def test_a_rank_killed_mid_training_resumes_from_the_last_checkpoint(
    rank, recorder, faults, restart_count, shared_tmp_path
) -> None:
    seed_data(shared_tmp_path, 1)
    # rank 1 dies as it enters its 3rd step of the 2nd epoch: epoch 0's checkpoint is written
    faults.kill(rank=1, at=f"dist.all_reduce#{steps_per_epoch(2) + 3}")
    trainer, resumed = checkpointing_fit(
        recorder, shared_tmp_path, checkpoint_dir=shared_tmp_path / "ckpt", resume=True
    )
    assert restart_count == 1, "the fit was not interrupted"
    assert trainer.resumed_from == 0, (
        f"the restarted fit did not resume from epoch 0's checkpoint ({trainer.resumed_from=})"
    )
    timeline = recorder.timeline()
    started = [s.rank for s in timeline.spans("on_train_epoch_start")]
    assert started == [0, 0, 1, 1], f"the restarted fit trained epochs on ranks {started}, expected 2 each"
    # no rank goes on while rank 0 may still be writing: a rank dying then would restart from a torn file
    timeline.assert_happens_before("save_checkpoint@0", "on_fit_end")
    timeline.assert_no_noop_barriers()
    recorder.close()
    _, uninterrupted = checkpointing_fit(None, shared_tmp_path)
    assert torch.equal(resumed, uninterrupted), "the resumed fit ends with other parameters than an uninterrupted one"


class StepClock(Callback):
    def __init__(self) -> None:
        self.last = time.monotonic()

    def on_train_batch_end(self, trainer, module, loss, batch, batch_idx) -> None:
        self.last = time.monotonic()


@pytest.mark.multirank(world_size=2, timeout=LIMIT)
def test_a_rank_killed_without_restarts_fails_the_fit_of_the_others_fast(rank, faults, shared_tmp_path) -> None:
    seed_data(shared_tmp_path, 1)
    faults.kill(rank=1, at="dist.all_reduce#3")
    clock = StepClock()
    trainer = Trainer("ddp", bugs=SEEDED, timeout=60.0, ddp_comm_hook=allreduce_hook, callbacks=[clock])
    with pytest.raises(RuntimeError):  # gloo's closed connection, not a hang until the timeout
        trainer.fit(RegressionModule(), RegressionDataModule(shared_tmp_path))
    assert time.monotonic() - clock.last < 5, "rank 0's fit took more than 5 s to fail after its peer died"
