"""Lightning (pinned in ci/constraints.txt) under the plugin: its DDP launcher relaunching the
command line for rank 1, its kept-alive group, its progress bars, on plugin-launched ranks.
The plugin reports what Lightning leaks into the pytest process and nothing else, and never
turns Lightning's own control flow (a rank's exit status decides whether it kills the job)
into a crash of the session."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from lightning_steps import OPTIMIZER_AND_DATA

pytest.importorskip("lightning")

MODEL = (
    """
import os
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _destroy_dist_connection


class Model(pl.LightningModule):
    def __init__(self, fail_on_rank=None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_on_rank = fail_on_rank

    def training_step(self, batch, _):
        if self.global_rank == self.fail_on_rank:
            raise RuntimeError(f"rank {self.global_rank} blew up")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
"""
    + OPTIMIZER_AND_DATA
    + """


def fit(tmp_path, devices=2, strategy="ddp", **kwargs):
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, default_root_dir=tmp_path,
        logger=False, enable_model_summary=False, **kwargs
    )
    trainer.fit(Model(fail_on_rank=int(os.environ.get("FAIL_ON_RANK", "-1"))))
    return trainer
"""
)


def test_special_test_with_lightnings_ddp_launcher(pytester, tmp_path) -> None:
    """Lightning relaunches `python -m pytest ...` for rank 1: one result per test, rank 1's
    output as captured output, and no leak for rank 1 finishing its own session."""
    pytester.makepyfile(
        test_launcher=MODEL
        + """
@pytest.mark.special
def test_ddp_fit(tmp_path):
    assert fit(tmp_path, enable_checkpointing=False).state.finished

@pytest.mark.special
def test_ddp_fit_rank1_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL_ON_RANK", "1")
    fit(tmp_path, enable_checkpointing=False)

def test_after():
    pass
"""
    )
    xml = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={xml}", timeout=300)
    result.assert_outcomes(passed=2, failed=1)
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "3"
    result.stdout.no_fnmatch_line("*leaked*")
    result.stdout.fnmatch_lines(["*_ test_ddp_fit_rank1_fails _*", "*RuntimeError: rank 1 blew up*"])


def test_standalone_lightning_ddp_test(pytester) -> None:
    """One DDP test per session, as Lightning's standalone tests run: the group and variables
    Lightning leaves in the pytest process are reported there, rank 1's relaunched session
    ends cleanly, so Lightning never kills the session for it."""
    pytester.makepyfile(
        test_standalone=MODEL
        + """
def test_ddp_fit(tmp_path):
    assert fit(tmp_path, enable_checkpointing=False).state.finished
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, "a leak error, not a SIGKILL from Lightning's observer"
    # rank 1's session prints to the same terminal (its summary may come after this one's)
    summaries = [line for line in result.stdout.lines if line.startswith("=") and " passed" in line]
    assert [" 1 error" in line for line in summaries].count(True) == 1, "only the pytest process itself has a leak"
    result.stdout.fnmatch_lines(
        [
            "test_standalone.py::test_ddp_fit leaked (cleaned up before the next test):",
            "  the default process group (backend gloo, world size 2, group name '0') is still initialised",
        ]
    )
    result.stdout.no_fnmatch_line("*_ChildProcessObserver*")
    result.stdout.no_fnmatch_line("*could not be cleaned up safely*")


def test_standalone_lightning_ddp_test_with_lightnings_own_teardown(pytester) -> None:
    """With the fixture Lightning's own conftest uses to destroy the group, nothing leaks."""
    pytester.makepyfile(
        test_tidy=MODEL
        + """
@pytest.fixture(autouse=True)
def lightning_teardown():
    env = dict(os.environ)
    yield
    _destroy_dist_connection()
    os.environ.clear()
    os.environ.update(env)

def test_ddp_fit(tmp_path):
    assert fit(tmp_path, enable_checkpointing=False).state.finished
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    assert result.ret == pytest.ExitCode.OK
    summaries = [line for line in result.stdout.lines if line.startswith("=") and " passed" in line]
    assert summaries and all("error" not in line for line in summaries), summaries
    result.stdout.no_fnmatch_line("*leaked*")


def test_lightning_on_plugin_ranks_and_in_process(pytester) -> None:
    """On the plugin's ranks (Lightning creates and keeps its group there) and in the pytest
    process itself (progress bar, checkpoints, a single device)."""
    pytester.makepyfile(
        test_ranks=MODEL
        + """
@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_ddp_on_plugin_ranks(tmp_path, rank):
    trainer = fit(tmp_path)
    assert trainer.global_rank == rank and trainer.world_size == 2

def test_single_device_in_process(tmp_path):
    assert fit(tmp_path, devices=1, strategy="auto").state.finished
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*leaked*")


def test_after_a_fit_a_hang_still_gets_its_stacks_and_an_injected_kill_its_verdict(pytester) -> None:
    """Lightning saves every signal handler as a fit starts and puts them back as it ends;
    Python sees faulthandler's as the default, so SIGUSR1 (the harness's request for a
    stack) would then kill the rank: the dumps are armed again as soon as that happens."""
    pytester.makepyfile(
        test_after_fit=MODEL
        + """
import time
import torch.distributed as dist

@pytest.mark.multirank(world_size=2, init_process_group=False, timeout=8)
def test_hang_after_fit(tmp_path, rank):
    fit(tmp_path)
    if rank == 1:
        while True:
            time.sleep(0.05)
    dist.barrier()

@pytest.mark.multirank(world_size=2, init_process_group=False, timeout=30)
def test_kill_during_fit(tmp_path, rank, recorder, faults):
    model = Model()
    recorder.instrument(model, "training_step")
    faults.kill(rank=1, at="start:training_step#2")
    with pytest.raises(RuntimeError):
        pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, default_root_dir=tmp_path,
            logger=False, enable_model_summary=False, enable_checkpointing=False,
        ).fit(model)
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "  rank 0: blocked in barrier #* on the default group for *",
            "    stuck at test_after_fit.py:* in test_hang_after_fit: dist.barrier()",
            "  rank 1: still running",
            "    stuck at test_after_fit.py:* in test_hang_after_fit: time.sleep(0.05)",
        ]
    )
    result.stdout.no_fnmatch_line("*SIGUSR1*")
