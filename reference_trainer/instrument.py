"""Instrumentation of a fit for pytest-ddphooks: which methods become timeline events, and how.

Module hooks keep their plain names (``prepare_data``, ``setup``, ...), datamodule hooks are
``dm.<hook>``, callback hooks ``cb.<Class>.<hook>``; the strategy's ``barrier`` is a framework
barrier (so one that issued no collective shows as a no-op), ``model_to_device``,
``wrap_model``, ``save_checkpoint`` and ``load_checkpoint`` keep their names, and
``strategy.setup_environment`` / ``strategy.teardown`` bracket the group's life.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from .hooks import CALLBACK_HOOKS, Callback, DataModule, Module

if TYPE_CHECKING:
    from pytest_ddphooks import Recorder

    from .strategies import Strategy


class Trainer(Protocol):
    """What instrumenting a fit needs of the trainer (``reference_trainer.Trainer``)."""

    callbacks: list[Callback]
    _caller_instrumented: bool

    def add_strategy_hook(self, hook: Callable[[Strategy], None]) -> None: ...


MODULE_HOOKS = (
    "prepare_data",
    "setup",
    "configure_model",
    "configure_optimizers",
    "on_fit_start",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_fit_end",
    "teardown",
)
DATAMODULE_HOOKS = ("prepare_data", "setup", "train_dataloader", "teardown")


def instrument_module(recorder: Recorder, module: Module, *, steps: bool = False) -> None:
    """``steps=True`` also records every ``training_step`` (long timelines)."""
    recorder.instrument(module, *MODULE_HOOKS, *(("training_step",) if steps else ()))


def instrument_datamodule(recorder: Recorder, datamodule: DataModule) -> None:
    recorder.instrument(datamodule, *DATAMODULE_HOOKS, prefix="dm")


def instrument_callbacks(recorder: Recorder, callbacks: Iterable[Callback]) -> None:
    """Only the hooks a callback overrides: the others do nothing worth a row."""
    for cb in callbacks:
        own = [h for h in CALLBACK_HOOKS if getattr(type(cb), h, None) is not getattr(Callback, h)]
        if own:
            recorder.instrument(cb, *own, prefix=f"cb.{type(cb).__name__}")


def instrument_parts(
    recorder: Recorder,
    module: Module,
    datamodule: DataModule | None,
    callbacks: Iterable[Callback] = (),
    *,
    steps: bool = False,
) -> None:
    instrument_module(recorder, module, steps=steps)
    if datamodule is not None:
        instrument_datamodule(recorder, datamodule)
    instrument_callbacks(recorder, callbacks)


def instrument_strategy(recorder: Recorder, strategy: Strategy) -> None:
    recorder.instrument_barrier(strategy, "barrier")
    recorder.instrument(strategy, "model_to_device", "wrap_model", "save_checkpoint", "load_checkpoint")
    recorder.instrument(strategy, "setup_environment", "teardown", prefix="strategy")


def instrument_trainer(
    recorder: Recorder, trainer: Trainer, module: Module, datamodule: DataModule | None = None, *, steps: bool = False
) -> Recorder:
    """Instrument a fit that runs in this process (single, external, already-launched ddp).

    The module, datamodule and callbacks are instrumented now; the strategy, which ``fit``
    creates, as soon as it exists. The recorder is activated: a barrier is judged a no-op by
    the torch.distributed calls recorded inside it, so an inactive recorder would call every
    barrier a no-op. For ranks the trainer launches itself use ``Trainer(record=True)``:
    each rank records itself and ``fit`` returns the merged timeline. Undo with
    ``recorder.close()``.
    """
    recorder.activate()
    instrument_parts(recorder, module, datamodule, trainer.callbacks, steps=steps)
    trainer.add_strategy_hook(lambda strategy: instrument_strategy(recorder, strategy))
    trainer._caller_instrumented = True
    return recorder
