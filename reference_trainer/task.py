"""A small real task: regression of y = X @ w_true + noise with a tiny MLP, written to disk.

The data goes through the filesystem on purpose: ``prepare_data`` writes it, ``setup`` reads
it, so a rank that reaches ``setup`` before ``prepare_data`` finished on its node finds no
file — the failure a missing barrier causes in real programs. With
``prepare_data_per_node=True`` each simulated node gets its own folder (its "local disk"),
otherwise all nodes share one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .hooks import Callback, DataModule, Module

DATA_FILE = "regression.pt"


class RegressionDataModule(DataModule):
    """Synthetic regression data; ``slow_prepare`` seconds of sleep make prepare_data a "download"."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        n_samples: int = 256,
        n_features: int = 8,
        noise: float = 0.01,
        batch_size: int | None = None,
        data_seed: int = 1234,
        slow_prepare: float = 0.0,
    ) -> None:
        super().__init__()
        # with no folder given, a fresh one under the temp dir, removed again at teardown
        self.owns_dir = data_dir is None
        self.data_dir = os.fspath(
            data_dir or os.path.join(tempfile.gettempdir(), f"reference-trainer-{uuid.uuid4().hex}")
        )
        self.n_samples, self.n_features, self.noise = n_samples, n_features, noise
        self.batch_size = batch_size
        self.data_seed = data_seed
        self.slow_prepare = slow_prepare
        self.dataset: TensorDataset | None = None

    def folder(self) -> str:
        """This rank's view of the data: its node's folder, or the shared one."""
        trainer = self.trainer
        if trainer is not None and trainer.prepare_data_per_node:
            return os.path.join(self.data_dir, f"node{trainer.node_rank}")
        return os.path.join(self.data_dir, "shared")

    def make(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.data_seed)
        x = torch.randn(self.n_samples, self.n_features, generator=g)
        w_true = torch.randn(self.n_features, 1, generator=g)
        y = x @ w_true + self.noise * torch.randn(self.n_samples, 1, generator=g)
        return x, y

    def prepare_data(self) -> None:
        if self.slow_prepare:
            time.sleep(self.slow_prepare)
        folder = self.folder()
        os.makedirs(folder, exist_ok=True)
        x, y = self.make()
        # written under a private name then renamed: a reader sees the whole file or none
        tmp = os.path.join(folder, f".{DATA_FILE}.{os.getpid()}.tmp")
        torch.save({"x": x, "y": y}, tmp)
        os.replace(tmp, os.path.join(folder, DATA_FILE))

    def setup(self, stage: str) -> None:
        path = os.path.join(self.folder(), DATA_FILE)
        try:
            data = torch.load(path)
        except FileNotFoundError:
            rank = self.trainer.global_rank if self.trainer else 0
            raise FileNotFoundError(
                f"setup on rank {rank} found no data at {path}: prepare_data has not finished for this node"
            ) from None
        self.dataset = TensorDataset(data["x"], data["y"])

    def train_dataloader(self) -> DataLoader[Any]:
        if self.dataset is None:
            raise RuntimeError("train_dataloader() before setup()")
        size = self.batch_size or (self.trainer.batch_size if self.trainer else 16)
        return DataLoader(self.dataset, batch_size=size, shuffle=True, drop_last=True)

    def teardown(self, stage: str) -> None:
        self.dataset = None
        trainer = self.trainer
        if not self.owns_dir or trainer is None or trainer.local_rank != 0:
            return
        shutil.rmtree(self.folder(), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.data_dir)  # the last node out removes the root


class RegressionModule(Module):
    """A two-layer MLP trained with SGD on mean squared error."""

    def __init__(self, n_features: int = 8, hidden: int = 16, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        self.n_features, self.hidden, self.lr, self.optimizer_name = n_features, hidden, lr, optimizer

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # the trainer seeded every rank alike, so every rank builds the same initial weights
        self.model = nn.Sequential(nn.Linear(self.n_features, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.model.parameters(), lr=self.lr)
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)


class ParamSyncCheck(Callback):
    """After every step, all-gathers the flattened parameters and compares them bit for bit.

    Appends one bool per step to ``trainer.metrics["param_sync"]`` (reported back with the
    rank's result). Sharded (FSDP) parameters differ per rank by design and are not checked.
    """

    def on_train_batch_end(self, trainer: Any, module: Module, loss: torch.Tensor, batch: Any, batch_idx: int) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        assert module.model is not None
        params = [p.detach() for p in module.model.parameters()]
        if any(hasattr(p, "to_local") for p in params):
            return
        flat = torch.cat([p.reshape(-1) for p in params])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        trainer.metrics.setdefault("param_sync", []).append(all(torch.equal(g, gathered[0]) for g in gathered))
