"""Processes launched from outside: the trainer creates the group itself, or uses the one there is.

The "outside launcher" here is the test: one rank, torchrun's variables, and a store served
from a loopback socket it keeps (the group joins it as a client, as under torchrun).
"""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from reference_trainer import RegressionDataModule, RegressionModule, Trainer
from reference_trainer.strategies import DDPStrategy, ExternalStrategy


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    port = sock.getsockname()[1]
    wait = timedelta(seconds=30)
    # the store owns the descriptor from here on and closes it when it goes; only this frame
    # may hold it (a yielded value stays referenced by pytest past the leak check)
    held = [dist.TCPStore("127.0.0.1", port, 1, True, wait, wait_for_workers=False, master_listen_fd=sock.detach())]
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():  # only a failed test gets here with a group
        dist.destroy_process_group()
    held.clear()


@pytest.mark.parametrize("strategy", ["external", "ddp", "fsdp"])
def test_launched_rank_creates_and_destroys_its_group(launched, tmp_path, strategy: str) -> None:
    seen = []
    trainer = Trainer(strategy, max_epochs=2, record=True, on_strategy=seen.append)
    module = RegressionModule()
    result = trainer.fit(module, RegressionDataModule(tmp_path))
    if strategy == "fsdp":
        # fully_shard made the network hold its DeviceMesh, and through it the (destroyed)
        # group's sockets, in reference cycles: they go when the module is collected
        assert isinstance(module.model, FSDPModule)
    else:
        assert type(module.model) is torch.nn.Sequential  # unwrapped at teardown
    del module
    gc.collect()
    assert isinstance(seen[0], ExternalStrategy if strategy == "external" else DDPStrategy)
    assert seen[0].owns_group is False  # released at teardown
    assert not dist.is_initialized()
    assert result.final_loss < 0.5 * result.initial_loss
    timeline = result.timeline
    assert timeline is not None
    timeline.assert_order(["strategy.setup_environment", "dist.init_process_group", "dm.prepare_data", "barrier"])
    timeline.assert_order(["strategy.teardown", "dist.destroy_process_group"])
    timeline.assert_no_noop_barriers()


def test_an_existing_group_is_used_and_left_alone(launched, tmp_path) -> None:
    dist.init_process_group("gloo", init_method="env://")
    try:
        result = Trainer("ddp", record=True).fit(RegressionModule(), RegressionDataModule(tmp_path))
        assert dist.is_initialized()
        assert result.timeline is not None
        assert not result.timeline.spans("dist.init_process_group")
        assert not result.timeline.spans("dist.destroy_process_group")
    finally:
        dist.destroy_process_group()


def test_external_without_a_launcher_says_so(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="torchrun"):
        Trainer("external").fit(RegressionModule(), RegressionDataModule(tmp_path))


def test_late_group_makes_the_first_barrier_a_noop(launched, tmp_path) -> None:
    trainer = Trainer("external", record=True, bugs={"group_after_prepare_data"})
    result = trainer.fit(RegressionModule(), RegressionDataModule(tmp_path))
    assert result.timeline is not None
    noops = result.timeline.noop_barriers()
    assert len(noops) == 1 and "no process group existed" in noops[0].reason
    result.timeline.assert_order(["dm.prepare_data", "barrier", "dm.setup", "dist.init_process_group", "barrier"])


def test_teardown_keeps_group_leaves_it_initialised(launched, tmp_path) -> None:
    Trainer("external", bugs={"teardown_keeps_group"}).fit(RegressionModule(), RegressionDataModule(tmp_path))
    try:
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
