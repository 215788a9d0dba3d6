"""Checkpoints of a fit: one file per finished epoch in ``checkpoint_dir``, written by global
rank 0 and read by every rank when a fit resumes.

The state is the full (unsharded) model and optimizer state: under FSDP2 gathering it is a
collective every rank takes part in, and loading it hands each rank its own shard again, so
a checkpoint is the same file whatever the strategy and world size that wrote it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

NAME = "epoch-{:04d}.pt"
_NAME = re.compile(r"epoch-(\d{4,})\.pt")


def path_for(folder: str | os.PathLike[str], epoch: int) -> Path:
    return Path(folder) / NAME.format(epoch)


def latest(folder: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The checkpoint of the last finished epoch in ``folder``, or None when there is none."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return None
    epochs = [int(m.group(1)) for m in map(_NAME.fullmatch, names) if m is not None]
    if not epochs:
        return None
    epoch = max(epochs)
    return epoch, path_for(folder, epoch)


def _sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())  # FSDP2's DTensors


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full model and optimizer state, complete on global rank 0 (every rank must call it:
    under FSDP2 it all-gathers the shards). ``model`` is unwrapped (no DDP ``module.`` prefix)."""
    if not _sharded(model):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return {"model": model_state, "optimizer": optimizer_state}


def restore_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full state into this rank's model and optimizer (each FSDP2 rank keeps its shard)."""
    if not _sharded(model):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if not state["optimizer"].get("state"):
        # an optimizer without state (SGD without momentum) has nothing to load, and torch
        # 2.13's full-state loader fails on it ("Expected device to be set")
        set_model_state_dict(model, state["model"], options=_options())
        return
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_options(),
    )
