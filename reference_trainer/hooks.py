"""The user-facing hook classes: what a training program overrides to plug into the lifecycle.

Every hook has a default that does nothing, except the two a program cannot do without
(``configure_optimizers`` and ``training_step``). The trainer sets ``trainer`` on a module or
datamodule before calling any hook, so hooks can ask for the rank they run on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader


class Trainer(Protocol):
    """The trainer as hooks see it (``reference_trainer.Trainer``)."""

    current_epoch: int
    global_step: int

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...


class Module:
    """A training program: builds its network in ``configure_model`` and trains it step by step.

    The network lives in ``self.model``; after ``configure_model`` the trainer moves it to the
    device and replaces it with the wrapped one (DDP, FSDP), so ``training_step`` must call
    ``self.model`` rather than keep its own reference to the unwrapped network.
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.model: nn.Module | None = None

    def prepare_data(self) -> None:
        """Download or write data, once per node (or once): no state may be set here."""

    def setup(self, stage: str) -> None:
        """Per-rank set-up that may rely on prepare_data having finished everywhere."""

    def configure_model(self) -> None:
        """Build ``self.model`` here (after the group exists, before it is wrapped)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define training_step()")

    def on_fit_start(self) -> None: ...

    def on_train_epoch_start(self) -> None: ...

    def on_train_batch_end(self, loss: torch.Tensor, batch: Any, batch_idx: int) -> None: ...

    def on_train_epoch_end(self) -> None: ...

    def on_fit_end(self) -> None: ...

    def teardown(self, stage: str) -> None: ...


class DataModule:
    """Data on its own: ``prepare_data`` writes it (once per node), ``setup`` reads it (every rank)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def prepare_data(self) -> None: ...

    def setup(self, stage: str) -> None: ...

    def train_dataloader(self) -> DataLoader[Any]:
        raise NotImplementedError(f"{type(self).__name__} must define train_dataloader()")

    def teardown(self, stage: str) -> None: ...


class Callback:
    """Code that watches a fit from outside the module; called after the module's own hook.

    ``prepare_data`` is deliberately not a callback hook: it runs on a subset of ranks only,
    and a callback that assumed otherwise would desynchronise the ranks.
    """

    def setup(self, trainer: Trainer, module: Module, stage: str) -> None: ...

    def on_fit_start(self, trainer: Trainer, module: Module) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, module: Module, loss: torch.Tensor, batch: Any, batch_idx: int
    ) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None: ...

    def on_fit_end(self, trainer: Trainer, module: Module) -> None: ...

    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None: ...


CALLBACK_HOOKS = (
    "setup",
    "on_fit_start",
    "on_train_epoch_start",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_fit_end",
    "teardown",
)
