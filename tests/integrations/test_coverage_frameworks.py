"""Coverage of code only real frameworks run on ranks: a LightningModule's hooks under
Lightning's DDP strategy, an Accelerate script's main-process branch and a DeepSpeed step's
rank-0 branch, each on the plugin's ranks, measured with pytest-cov and nothing set up."""

from __future__ import annotations

import pytest
from deepspeed_op import HAVE_DEEPSPEED, shared_memory_op_or_skip
from lightning_steps import OPTIMIZER_AND_DATA

pytest.importorskip("pytest_cov", reason="pytest-cov is installed with the test extras (ci/constraints.txt)")

LIGHTNING_MODEL = (
    """
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def setup(self, stage):
        if self.global_rank == 0:
            self.role = "writer"
        else:
            self.role = "reader"

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
"""
    + OPTIMIZER_AND_DATA
)

LIGHTNING_TEST = """
import pytest
import lightning.pytorch as pl
from mycode.model import Model


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_fit_on_ranks(tmp_path, rank):
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, default_root_dir=tmp_path,
        logger=False, enable_model_summary=False, enable_checkpointing=False, enable_progress_bar=False,
    )
    model = Model()
    trainer.fit(model)
    assert model.role == ("writer" if rank == 0 else "reader")
"""

ACCELERATE_CODE = """
from accelerate import PartialState


def prepare(state):
    with state.main_process_first():
        if state.is_main_process:
            return "downloaded"
        return "read the download"


def run():
    state = PartialState(cpu=True)
    done = prepare(state)
    state.wait_for_everyone()
    return done
"""

ACCELERATE_TEST = """
import pytest
from mycode.script import run


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_script_on_ranks(rank):
    assert run() == ("downloaded" if rank == 0 else "read the download")
"""


DEEPSPEED_CODE = """
import deepspeed
import deepspeed.comm as dcomm


def checkpoint_role():
    deepspeed.init_distributed(dist_backend="gloo")
    if dcomm.get_rank() == 0:
        role = "writes the checkpoint"
    else:
        role = "reads it"
    dcomm.barrier()
    return role
"""

DEEPSPEED_TEST = """
import pytest
from mycode.steps import checkpoint_role


@pytest.mark.multirank(world_size=2)
def test_roles_on_ranks(rank):
    assert checkpoint_role() == ("writes the checkpoint" if rank == 0 else "reads it")
"""


def _project(pytester: pytest.Pytester, module: str, code: str, test: str) -> pytest.RunResult:
    pytester.mkpydir("mycode")
    (pytester.path / "mycode" / f"{module}.py").write_text(code)
    pytester.makepyfile(test_on_ranks=test)
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--cov=mycode", "--cov-branch", "--cov-report=term-missing", timeout=300
    )


def test_a_lightning_modules_hooks_run_on_ranks_count(pytester: pytest.Pytester) -> None:
    pytest.importorskip("lightning")
    result = _project(pytester, "model", LIGHTNING_MODEL, LIGHTNING_TEST)
    result.assert_outcomes(passed=1)
    # Stmts Miss Branch BrPart Cover: setup's two branches, each taken on one rank only
    result.stdout.fnmatch_lines(["mycode/model.py * 0 * 2 * 0 * 100%"])
    assert not list(pytester.path.glob(".coverage.*")), "no data file of a rank left behind"


def test_an_accelerate_scripts_main_process_branch_counts(pytester: pytest.Pytester) -> None:
    pytest.importorskip("accelerate")
    result = _project(pytester, "script", ACCELERATE_CODE, ACCELERATE_TEST)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["mycode/script.py * 0 * 2 * 0 * 100%"])


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed (ci/constraints.txt pins it)")
def test_a_deepspeed_steps_rank_zero_branch_counts(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    shared_memory_op_or_skip(monkeypatch)
    result = _project(pytester, "steps", DEEPSPEED_CODE, DEEPSPEED_TEST)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["mycode/steps.py * 0 * 2 * 0 * 100%"])
