"""Schedule exploration on frameworks nobody here wrote: with the synchronisation they use for
"rank 0 prepares, then everyone reads" taken away, the race hides under normal timing and
exploration finds it; left as they ship, every schedule passes (no false failure, no deadlock,
no desync on their own collectives).

Lightning and Accelerate are pinned in ci/constraints.txt."""

from __future__ import annotations

import importlib.util

import pytest
from lightning_steps import DATAMODULE_MODEL

HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None

# the other ranks are a moment late to read (a tokenizer to load first): under normal timing
# rank 0 has written long before, so the plain run passes with or without the barriers
LATE_READER = """
def busy(n):
    return sum(i * i for i in range(n))


def read_late(path, rank):
    if rank != 0:
        busy(3_000_000)
    if not path.exists():
        raise FileNotFoundError(f"rank {rank} found no data at {path.name}: rank 0 has not written it yet")
    return path.read_text()
"""

LIGHTNING = (
    """
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _InfiniteBarrier
from lightning.pytorch.strategies import DDPStrategy
"""
    + LATE_READER
    + """

class Data(pl.LightningDataModule):
    def __init__(self, folder):
        super().__init__()
        self.path = folder / "data.txt"

    def prepare_data(self):  # Lightning runs it on rank 0 of the node only
        self.path.write_text("16")

    def setup(self, stage):
        n = int(read_late(self.path, self.trainer.global_rank))
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

"""
    + DATAMODULE_MODEL
    + """


@pytest.mark.parametrize("barriers", ["kept", "gone"])
@pytest.mark.multirank(world_size=2, init_process_group=False, timeout=60)
def test_fit(rank, recorder, shared_tmp_path, monkeypatch, barriers):
    if barriers == "gone":
        monkeypatch.setattr(DDPStrategy, "barrier", lambda self, name=None: None)
        monkeypatch.setattr(_InfiniteBarrier, "__enter__", lambda self: self)
        monkeypatch.setattr(_InfiniteBarrier, "__exit__", lambda self, *exc: None)
    data = Data(shared_tmp_path)
    recorder.instrument(data, "prepare_data", "setup", prefix="dm")  # points a schedule can hold at
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, default_root_dir=shared_tmp_path,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), datamodule=data)
    assert trainer.state.finished
"""
)

ACCELERATE = (
    """
import pytest
from accelerate import PartialState
"""
    + LATE_READER
    + """

@pytest.mark.parametrize("waits", ["kept", "gone"])
@pytest.mark.multirank(world_size=2, init_process_group=False, timeout=60)
def test_main_process_first(rank, recorder, shared_tmp_path, monkeypatch, waits):
    state = PartialState(cpu=True)
    if waits == "gone":
        monkeypatch.setattr(type(state), "wait_for_everyone", lambda self: None)
    path = shared_tmp_path / "vocab.txt"
    with state.main_process_first():
        if state.is_main_process:
            recorder.mark("write")
            path.write_text("a b c")
        else:
            assert read_late(path, rank) == "a b c"
    state.wait_for_everyone()
"""
)


def _explore(pytester: pytest.Pytester, source: str) -> None:
    pytester.makepyfile(test_framework=source)
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=600)
    plain.assert_outcomes(passed=2)  # under normal timing the race hides
    explored = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-explore=12", "-rA", timeout=900)
    explored.assert_outcomes(passed=1, failed=1)
    explored.stdout.fnmatch_lines(
        [
            "*_ test_*[[]gone[]] _*",
            "failed under schedule * of 12 (seed 0x*); replay with --ddp-schedule=0x*",
            "*rank 1: failed: FileNotFoundError: rank 1 found no data at *: rank 0 has not written it yet",
        ]
    )
    explored.stdout.fnmatch_lines(["*_ test_*[[]kept[]] _*", "passed under all 12 schedules explored *"])
    explored.stdout.no_fnmatch_line("*desync*")


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="lightning is not installed (ci/constraints.txt pins it)")
def test_exploration_finds_a_lightning_prepare_data_race_the_barriers_prevent(pytester: pytest.Pytester) -> None:
    _explore(pytester, LIGHTNING)


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed (ci/constraints.txt pins it)")
def test_exploration_finds_an_accelerate_main_process_first_race(pytester: pytest.Pytester) -> None:
    _explore(pytester, ACCELERATE)
