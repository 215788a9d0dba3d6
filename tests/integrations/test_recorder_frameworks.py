"""The recorder on frameworks nobody here wrote: what each one uses to synchronise is seen,
proves the order it enforces, and nothing proves an order once that synchronisation is gone.

Lightning and Accelerate are pinned in ci/constraints.txt; FSDP2 and DTensor come with torch."""

from __future__ import annotations

import importlib.util

import pytest
from lightning_steps import DATAMODULE_MODEL

HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None

LIGHTNING = (
    """
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.fabric.utilities.distributed import _InfiniteBarrier
from lightning.pytorch.strategies import DDPStrategy
from pytest_ddphooks import TimelineAssertionError

HOOKS = ("setup", "on_fit_start", "on_train_epoch_start", "on_train_epoch_end", "on_fit_end", "teardown")


class Data(pl.LightningDataModule):
    def prepare_data(self):
        pass

    def setup(self, stage):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

"""
    + DATAMODULE_MODEL
    + """


def fit(tmp_path, recorder):
    data, model = Data(), Model()
    recorder.instrument(data, "prepare_data", "setup", prefix="dm")
    recorder.instrument(model, *HOOKS)
    recorder.instrument_barrier(DDPStrategy, "barrier")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, default_root_dir=tmp_path,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    return recorder.timeline()


def no_infinite_barrier(monkeypatch):
    # _InfiniteBarrier as if it never found the group: its barrier is a no-op
    monkeypatch.setattr(_InfiniteBarrier, "__enter__", lambda self: self)
    monkeypatch.setattr(_InfiniteBarrier, "__exit__", lambda self, *exc: None)


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_trainer_hook_order_and_barriers(rank, recorder, tmp_path):
    tl = fit(tmp_path, recorder)
    tl.assert_called_once("dm.prepare_data@0")
    tl.assert_order(["dm.prepare_data", "dm.setup", *HOOKS], rank=0)
    tl.assert_order(["dm.setup", *HOOKS], rank=1)
    tl.assert_happens_before("dm.prepare_data@0", "dm.setup")
    assert tl.noop_barriers() == []
    tl.assert_collectives_match()
    monitored = [e for e in tl.for_rank(rank) if e.name == "dist.monitored_barrier" and e.phase == "start"]
    assert monitored and all(e.info["api"] == "ProcessGroup.monitored_barrier" for e in monitored)


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_the_infinite_barrier_alone_orders_prepare_data(rank, recorder, tmp_path, monkeypatch):
    monkeypatch.setattr(DDPStrategy, "barrier", lambda self, name=None: None)
    fit(tmp_path, recorder).assert_happens_before("dm.prepare_data@0", "dm.setup")


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_without_either_barrier_the_order_is_refused(rank, recorder, tmp_path, monkeypatch):
    monkeypatch.setattr(DDPStrategy, "barrier", lambda self, name=None: None)
    no_infinite_barrier(monkeypatch)
    tl = fit(tmp_path, recorder)
    with pytest.raises(TimelineAssertionError, match="'dm.prepare_data@0' does not happen before 'dm.setup'"):
        tl.assert_happens_before("dm.prepare_data@0", "dm.setup")


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_fabric_rank_zero_first(rank, recorder):
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    with fabric.rank_zero_first():
        recorder.mark("download")
    recorder.timeline().assert_happens_before("download@0", "download@1")


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_fabric_rank_zero_first_without_its_barrier(rank, recorder, monkeypatch):
    no_infinite_barrier(monkeypatch)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    with fabric.rank_zero_first():
        recorder.mark("download")
    with pytest.raises(TimelineAssertionError):
        recorder.timeline().assert_happens_before("download@0", "download@1")


@pytest.mark.multirank(world_size=2, init_process_group=False)
@pytest.mark.parametrize("its_barrier", ["kept", "gone"])
def test_rank_zero_first_is_a_barrier_of_its_own(rank, recorder, monkeypatch, its_barrier):
    # a @contextmanager barrier: its _InfiniteBarrier's collectives are its own, the block's are not
    if its_barrier == "gone":
        no_infinite_barrier(monkeypatch)
    recorder.instrument_barrier(Fabric, "rank_zero_first")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    with fabric.rank_zero_first():
        if its_barrier == "gone":
            fabric.barrier()  # the block's own synchronisation (kept, rank 0 would wait here for rank 1)
    found = [(nb.rank, nb.name) for nb in recorder.timeline().noop_barriers()]
    assert found == ([] if its_barrier == "kept" else [(0, "rank_zero_first"), (1, "rank_zero_first")])
"""
)

ACCELERATE = """
import pytest
import torch
from accelerate import PartialState
from pytest_ddphooks import TimelineAssertionError


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_main_process_first(rank, recorder):
    state = PartialState(cpu=True)
    with state.main_process_first():
        recorder.mark("download")
    state.wait_for_everyone()
    recorder.mark("train")
    tl = recorder.timeline()
    tl.assert_happens_before("download@0", "download@1")
    tl.assert_happens_before("download", "train")


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_main_process_first_without_wait_for_everyone(rank, recorder, monkeypatch):
    state = PartialState(cpu=True)
    monkeypatch.setattr(type(state), "wait_for_everyone", lambda self: None)
    with state.main_process_first():
        recorder.mark("download")
    with pytest.raises(TimelineAssertionError, match="'download@0' does not happen before 'download@1'"):
        recorder.timeline().assert_happens_before("download@0", "download@1")


@pytest.mark.multirank(world_size=2, init_process_group=False)
@pytest.mark.parametrize("waits", ["kept", "gone"])
def test_main_process_first_is_a_barrier_of_its_own(rank, recorder, monkeypatch, waits):
    state = PartialState(cpu=True)
    if waits == "gone":
        monkeypatch.setattr(type(state), "wait_for_everyone", lambda self: None)
    recorder.instrument_barrier(type(state), "main_process_first")
    with state.main_process_first():
        torch.distributed.barrier()  # the block's own synchronisation: not the barrier's
    found = [(nb.rank, nb.name) for nb in recorder.timeline().noop_barriers()]
    assert found == ([] if waits == "kept" else [(0, "main_process_first"), (1, "main_process_first")])
"""

TORCH_PARALLEL = """
import torch
import torch.distributed as dist
import pytest
from pytest_ddphooks import TimelineAssertionError


@pytest.mark.multirank(world_size=2)
def test_fsdp2_step_collectives_pair_on_every_rank(rank, recorder):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    tl = recorder.timeline()
    ops = {r: [(e.name, e.info["seq"]) for e in tl.for_rank(r) if e.kind == "collective" and e.phase == "start"]
           for r in tl.ranks}
    gathers = [name for name, _ in ops[0] if name == "dist.all_gather_single"]
    scatters = [name for name, _ in ops[0] if name == "dist.reduce_scatter_single"]
    assert len(gathers) >= 2 and len(scatters) >= 1, ops[0]
    assert ops[0] == ops[1], "the same collectives, with the same sequence numbers, on every rank"
    tl.assert_collectives_match()
    assert tl.never_waited() == []


@pytest.mark.multirank(world_size=2)
def test_dtensor_full_tensor_orders_a_shard_written_before_it(rank, recorder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    shards = distribute_tensor(torch.zeros(4), mesh, [Shard(0)])
    if rank == 0:
        shards.to_local().fill_(1.0)
        recorder.mark("wrote")
    full = shards.full_tensor()
    recorder.mark("read")
    assert full.tolist() == [1.0, 1.0, 0.0, 0.0]
    tl = recorder.timeline()
    tl.assert_happens_before("wrote@0", "read@1")
    apis = {e.info.get("api") for e in tl.for_rank(rank) if e.kind == "collective" and e.phase == "start"}
    assert "functional.all_gather_single" in apis, apis


@pytest.mark.multirank(world_size=2)
def test_functional_collective_orders_from_its_wait(rank, recorder):
    import torch.distributed._functional_collectives as funcol

    if rank == 0:
        recorder.mark("before")
    out = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    assert out.tolist() == [2.0, 2.0]  # using it waits for it
    recorder.mark("after")
    recorder.timeline().assert_happens_before("before@0", "after@1")


@pytest.mark.multirank(world_size=2)
def test_ddp_reducer_collectives_are_recorded_and_order_nothing(rank, recorder):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    if rank == 0:
        recorder.mark("before")
    model(torch.ones(1, 2)).sum().backward()  # its all-reduce is issued from C++
    recorder.mark("after")
    dist.barrier()
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError, match="issued from native code .gloo:all_reduce.: its completion"):
        tl.assert_happens_before("before@0", "after@1")
    seqs = [e.info["seq"] for e in tl.for_rank(rank) if e.phase == "start" and e.info.get("seq")]
    assert seqs == list(range(1, len(seqs) + 1)), "no gap: the reducer's collectives are in the sequence"
    reduced = [e for e in tl.for_rank(rank) if e.name == "dist.all_reduce" and e.phase == "start"]
    assert reduced and all(e.info["native"] for e in reduced)
    tl.assert_collectives_match()
"""


def _run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_frameworks=source)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=600)


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="lightning is not installed (ci/constraints.txt pins it)")
def test_lightning(pytester) -> None:
    result = _run(pytester, LIGHTNING)
    result.assert_outcomes(passed=7)


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed (ci/constraints.txt pins it)")
def test_accelerate(pytester) -> None:
    result = _run(pytester, ACCELERATE)
    result.assert_outcomes(passed=4)


def test_fsdp2_dtensor_functional_ddp(pytester) -> None:
    result = _run(pytester, TORCH_PARALLEL)
    result.assert_outcomes(passed=4)
