"""DeepSpeed on CPU ranks, for the integration tests: its shared-memory op built before any rank
starts, in a folder every inner session shares."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# read at import, before pytester points HOME at a fresh folder: the op is compiled once per machine
EXTENSIONS_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions" / "ddphooks")

BUILD_SHARED_MEMORY_OP = """
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None:
    builder.load(verbose=False)
"""


def shared_memory_op_or_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed's CPU backend compiles a shared-memory op the first time a process group starts
    # (cached per machine): build it here, outside the ranks' time limit, in an interpreter of its
    # own (importing deepspeed changes logging and torch for the process that does), or say why not
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)  # the ranks inherit it
    try:
        built = subprocess.run(
            [sys.executable, "-c", BUILD_SHARED_MEMORY_OP], capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        # torch waits for ever on the lock file of a build that was killed
        pytest.skip(
            f"DeepSpeed's CPU shared-memory op did not build in 300 s: a build killed earlier leaves"
            f" {EXTENSIONS_DIR}/deepspeed_shm_comm/lock behind; remove it if no build is running"
        )
    if built.returncode != 0:
        reason = (built.stderr.strip().splitlines() or ["no message"])[-1]
        pytest.skip(f"DeepSpeed's CPU shared-memory op cannot be built on this machine: {reason}")
