"""The Trainer and the order in which it calls everything. The lifecycle, on every rank::

    fit(module, datamodule):
        launch                        # ddp/ddp_spawn/fsdp with no group and no RANK: start
                                      # world_size rank processes; each runs what follows
        strategy = make_strategy()    # in the rank; then instrumentation, on_strategy(strategy)
        strategy.setup_environment()  # create the process group HERE (gloo, env://) unless
                                      # one exists already, in which case use it
        if local_rank == 0 (prepare_data_per_node) / global_rank == 0 (otherwise):
            datamodule.prepare_data(); module.prepare_data()
        strategy.barrier()            # nobody reads what prepare_data is still writing
        datamodule.setup("fit"); module.setup("fit"); callback.setup(trainer, module, "fit")
        strategy.barrier()            # every rank is set up before the model is built
        module.configure_model()
        model = strategy.model_to_device(module.model)   # exactly once per rank
        module.model = strategy.wrap_model(model)        # DDP, or FSDP2 fully_shard
        optimizer = module.configure_optimizers()
        if resume and a checkpoint exists in checkpoint_dir:
            strategy.load_checkpoint(latest)   # every rank; model and optimizer state, epoch
        module.on_fit_start(); callback.on_fit_start(trainer, module)
        loader = train_dataloader()   # with a DistributedSampler when distributed
        for epoch in range(first epoch not in the checkpoint, max_epochs):
            on_train_epoch_start
            for batch_idx, batch in loader: training_step, backward, step, on_train_batch_end
            on_train_epoch_end
            if checkpoint_dir:
                strategy.save_checkpoint(...)  # the full state gathered on every rank, written by rank 0
                strategy.barrier()             # nobody goes on (or dies and restarts) before it is whole
        on_fit_end
        finally:                      # on success and on failure alike
            datamodule.teardown("fit"); module.teardown("fit"); callback.teardown(..., "fit")
            module.model = strategy.unwrap_model(module.model)   # drop the DDP wrapper
            strategy.teardown()       # destroy the group if (and only if) this fit created it

Module hooks run before the callbacks' hooks of the same name; the datamodule's before both.
``train_dataloader`` comes from the datamodule, or from the module when there is none.
``ddp_spawn`` differs in one place, see ``ORDER``; ``LIFECYCLE`` lists the instrumented names
every rank goes through, for ``Timeline.assert_order``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from . import bugs as B
from . import checkpoint, instrument
from .hooks import Callback, DataModule, Module
from .launch import launch
from .results import FitResult, RankOutput
from .strategies import CommHook, Strategy, make_strategy, strategy_class

if TYPE_CHECKING:
    from pytest_ddphooks import Recorder, Timeline

ORDER = """Where the order differs between strategies:

single      one process, no group: both barriers are no-ops (by design); world size 1.
external    the processes exist already; setup_environment creates the group through env://
            unless one exists (then it is used and not destroyed).
ddp, fsdp   with a group or RANK set: exactly external. Otherwise fit forks world_size ranks
            first (loopback store, GLOO_SOCKET_IFNAME=lo) and each runs the whole lifecycle.
ddp_spawn   launched by fit: prepare_data runs in the launching process BEFORE any rank exists,
            once for every rank that would have prepared (local rank 0 of each node, or global
            rank 0), then the ranks are spawned (module, datamodule, trainer pickled in) and
            skip prepare_data; everything else is as ddp. Already launched: exactly ddp.
"""

# The instrumented names every rank goes through, in order (prepare_data only runs on some).
LIFECYCLE = (
    "strategy.setup_environment",
    "barrier",
    "dm.setup",
    "setup",
    "barrier",
    "configure_model",
    "model_to_device",
    "wrap_model",
    "configure_optimizers",
    "on_fit_start",
    "dm.train_dataloader",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_fit_end",
    "dm.teardown",
    "teardown",
    "strategy.teardown",
)


class Trainer:
    """Runs the lifecycle above for a Module on one of the strategies.

        ``checkpoint_dir`` (a folder every rank sees) gets a checkpoint at the end of every epoch;
    with ``resume=True`` a fit starts from the latest one there, as a rank restarted by an
    elastic agent does. ``ddp_comm_hook`` is registered on the DDP wrapper (e.g. torch's
    ``default_hooks.allreduce_hook``, which all-reduces each gradient bucket from Python).

        ``bugs`` switches on seeded historical bugs (``reference_trainer.bugs``). ``record=True``
        records every rank into its own Recorder and gives ``FitResult.timeline`` (merged across
        ranks when the trainer launched them); ``recorder=`` instruments into a recorder you own
        (in-process strategies only, e.g. the ``recorder`` of a multirank test). ``on_strategy``
        is called in each rank with the new strategy, before ``setup_environment``.
    """

    def __init__(
        self,
        strategy: str | type[Strategy] = "single",
        *,
        max_epochs: int = 1,
        prepare_data_per_node: bool = True,
        world_size: int | None = None,
        num_nodes: int = 1,
        callbacks: Sequence[Callback] = (),
        batch_size: int = 16,
        seed: int = 0,
        bugs: Iterable[str] = (),
        record: bool = False,
        recorder: Recorder | None = None,
        on_strategy: Callable[[Strategy], None] | None = None,
        timeout: float = 300.0,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        resume: bool = False,
        ddp_comm_hook: CommHook | None = None,
    ) -> None:
        if resume and checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir: the folder to resume from")
        self.strategy_spec = strategy
        self.max_epochs = max_epochs
        self.prepare_data_per_node = prepare_data_per_node
        self.world_size_arg = world_size
        self.num_nodes = num_nodes
        self.callbacks = list(callbacks)
        self.batch_size = batch_size
        self.seed = seed
        self.bugs = B.check(bugs)
        self.record = record
        self.recorder_arg = recorder
        self.on_strategy = on_strategy
        self.timeout = timeout
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.resume = resume
        self.ddp_comm_hook = ddp_comm_hook
        strategy_class(strategy, ddp_comm_hook)
        # per fit, in the rank
        self.strategy: Strategy | None = None
        self.recorder: Recorder | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.losses: list[float] = []
        self.metrics: dict[str, Any] = {}
        self.current_epoch = 0
        self.global_step = 0
        self.timeline: Timeline | None = None
        self._strategy_hooks: list[Callable[[Strategy], None]] = []
        self._caller_instrumented = False
        self._launched = False  # set inside a rank this trainer launched
        self.failed_at_ns: int | None = None  # when this rank's fit raised
        self.resumed_from: int | None = None  # the epoch of the checkpoint this fit resumed from

    # -- rank information (of the current fit's strategy) -----------------------------------

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank if self.strategy else 0

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank if self.strategy else 0

    @property
    def node_rank(self) -> int:
        return self.strategy.node_rank if self.strategy else 0

    @property
    def world_size(self) -> int:
        return self.strategy.world_size if self.strategy else 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def add_strategy_hook(self, hook: Callable[[Strategy], None]) -> None:
        """Call ``hook(strategy)`` in each rank once its strategy exists (before setup_environment)."""
        self._strategy_hooks.append(hook)

    def new_strategy(self) -> Strategy:
        return make_strategy(
            self.strategy_spec,
            num_nodes=self.num_nodes,
            world_size=self.world_size_arg,
            bugs=self.bugs,
            timeout=self.timeout,
            ddp_comm_hook=self.ddp_comm_hook,
        )

    # -- fit ---------------------------------------------------------------------------------

    def fit(self, module: Module, datamodule: DataModule | None = None) -> FitResult:
        strategy = self.new_strategy()
        if not self._launched and strategy.needs_launch():
            return launch(self, module, datamodule, strategy)
        out = self.fit_rank(module, datamodule, strategy)
        return FitResult({out.rank: out}, self.timeline)

    def fit_rank(
        self, module: Module, datamodule: DataModule | None, strategy: Strategy, event_file: str | None = None
    ) -> RankOutput:
        """The lifecycle in this process, as one rank; ``fit`` (or a launched rank) calls it."""
        self.strategy = strategy
        self.losses, self.metrics, self.current_epoch, self.global_step = [], {}, 0, 0
        self.timeline = None
        self.failed_at_ns = None
        module.trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        own: Recorder | None = None
        rec = self.recorder_arg
        if rec is None and self.record:
            from pytest_ddphooks import Recorder

            own = rec = Recorder(strategy.global_rank, strategy.world_size, event_file=event_file)
        self.recorder = rec
        try:
            if rec is not None:
                rec.activate()
                instrument.instrument_parts(rec, module, datamodule, self.callbacks)
                instrument.instrument_strategy(rec, strategy)
            for hook in self._strategy_hooks:
                hook(strategy)
            if self.on_strategy is not None:
                self.on_strategy(strategy)
            return self._lifecycle(module, datamodule, strategy)
        finally:
            if own is not None:
                self.timeline = own.timeline()
                own.close()

    def _lifecycle(self, module: Module, dm: DataModule | None, strategy: Strategy) -> RankOutput:
        bugs = self.bugs
        torch.manual_seed(self.seed)
        try:
            strategy.setup_environment()
            if not (self._launched and strategy.prepare_data_in_launcher) and self.should_prepare(strategy):
                self.prepare_data(module, dm)
            if B.NO_BARRIER_BEFORE_SETUP not in bugs:  # BUG no_barrier_before_setup skips it
                strategy.barrier("before_setup")
            if dm is not None:
                dm.setup("fit")
            module.setup("fit")
            for cb in self.callbacks:
                cb.setup(self, module, "fit")
            if B.GROUP_AFTER_PREPARE_DATA in bugs:
                strategy.create_group()  # BUG group_after_prepare_data: too late for the barrier before setup
            if B.BARRIER_RANK0_ONLY in bugs:
                if strategy.global_rank == 0:  # BUG barrier_rank0_only: the others never enter it
                    strategy.barrier("after_setup")
            elif B.NO_BARRIER_AFTER_SETUP not in bugs:  # BUG no_barrier_after_setup skips it
                strategy.barrier("after_setup")
            module.configure_model()
            if module.model is None:
                raise RuntimeError(f"{type(module).__name__}.configure_model() left self.model unset")
            model = strategy.model_to_device(module.model)
            module.model = strategy.wrap_model(model)
            self.optimizer = optimizer = module.configure_optimizers()
            first_epoch = self._resume(module, optimizer, strategy)
            self._call(module, "on_fit_start")
            loader = self._train_loader(module, dm, strategy)
            for epoch in range(first_epoch, self.max_epochs):
                self.current_epoch = epoch
                if isinstance(getattr(loader, "sampler", None), DistributedSampler):
                    loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
                self._call(module, "on_train_epoch_start")
                for batch_idx, batch in enumerate(loader):
                    loss = module.training_step(batch, batch_idx)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    self.global_step += 1
                    self.losses.append(float(loss.detach()))
                    self._call(module, "on_train_batch_end", loss.detach(), batch, batch_idx)
                self._call(module, "on_train_epoch_end")
                if self.checkpoint_dir is not None:
                    self._save_checkpoint(module, optimizer, strategy, epoch)
            self._call(module, "on_fit_end")
            return self._output(module, strategy)
        except BaseException:
            # taken before teardown, whose leaving the group makes the peers fail next
            self.failed_at_ns = time.time_ns()
            raise
        finally:
            try:
                if dm is not None:
                    dm.teardown("fit")
                module.teardown("fit")
                for cb in self.callbacks:
                    cb.teardown(self, module, "fit")
            finally:
                # nothing of this fit may keep the group alive once it is destroyed: the DDP
                # wrapper and the optimizer (over FSDP's DTensors) both hold it
                self.optimizer = None
                if module.model is not None:
                    module.model = strategy.unwrap_model(module.model)
                strategy.teardown()

    # -- pieces ------------------------------------------------------------------------------

    def should_prepare(self, strategy: Strategy) -> bool:
        """Whether the rank ``strategy`` stands for calls prepare_data."""
        if B.PREPARE_DATA_EVERY_RANK in self.bugs:
            return True  # BUG prepare_data_every_rank
        if B.PREPARE_DATA_RANK0_ONLY in self.bugs:
            return strategy.global_rank == 0  # BUG prepare_data_rank0_only: other nodes get nothing
        return strategy.local_rank == 0 if self.prepare_data_per_node else strategy.global_rank == 0

    def prepare_data(self, module: Module, dm: DataModule | None) -> None:
        if dm is not None:
            dm.prepare_data()
        module.prepare_data()

    def _save_checkpoint(
        self, module: Module, optimizer: torch.optim.Optimizer, strategy: Strategy, epoch: int
    ) -> None:
        assert module.model is not None and self.checkpoint_dir is not None
        model = strategy.unwrap_model(module.model)
        state = checkpoint.gather_state(model, optimizer)  # every rank: FSDP gathers shards
        # the random state too: the next epoch's shuffle draws from it, so a resumed fit sees
        # the batches an uninterrupted one would
        state.update(epoch=epoch, global_step=self.global_step, rng=torch.get_rng_state())
        strategy.save_checkpoint(state, checkpoint.path_for(self.checkpoint_dir, epoch))
        if B.CHECKPOINT_WITHOUT_BARRIER not in self.bugs:  # BUG checkpoint_without_barrier skips it
            strategy.barrier("checkpoint")

    def _resume(self, module: Module, optimizer: torch.optim.Optimizer, strategy: Strategy) -> int:
        """Load the latest checkpoint when resuming; the first epoch still to train."""
        self.resumed_from = None
        if not self.resume or self.checkpoint_dir is None:
            return 0
        found = checkpoint.latest(self.checkpoint_dir)
        if found is None or B.RESUME_IGNORES_CHECKPOINT in self.bugs:  # BUG resume_ignores_checkpoint
            return 0
        epoch, path = found
        state = strategy.load_checkpoint(path)
        assert module.model is not None
        checkpoint.restore_state(strategy.unwrap_model(module.model), optimizer, state)
        self.global_step = int(state["global_step"])
        torch.set_rng_state(state["rng"])
        self.resumed_from = epoch
        return epoch + 1

    def _call(self, module: Module, hook: str, *args: Any) -> None:
        getattr(module, hook)(*args)
        for cb in self.callbacks:
            getattr(cb, hook)(self, module, *args)

    def _train_loader(self, module: Module, dm: DataModule | None, strategy: Strategy) -> DataLoader[Any]:
        source: Any = dm if dm is not None else module
        make = getattr(source, "train_dataloader", None)
        if make is None:
            raise RuntimeError("no train_dataloader(): pass a DataModule, or define it on the Module")
        loader: DataLoader[Any] = make()
        if not strategy.distributed or strategy.world_size == 1 or isinstance(loader.sampler, DistributedSampler):
            return loader
        # each rank its own slice; drop_last keeps the step count equal so DDP never waits alone
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=strategy.world_size,
            rank=strategy.global_rank,
            shuffle=True,
            seed=self.seed,
            drop_last=True,
        )
        return DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn, drop_last=True
        )

    def _output(self, module: Module, strategy: Strategy) -> RankOutput:
        assert module.model is not None
        params: dict[str, torch.Tensor] = {}
        sharded: list[str] = []
        for name, p in strategy.unwrap_model(module.model).named_parameters():
            t = p.detach()
            if hasattr(t, "to_local"):  # an FSDP2 DTensor: keep this rank's shard, no collective
                t = t.to_local()
                sharded.append(name)
            params[name] = t.clone().cpu()
        return RankOutput(
            strategy.global_rank,
            strategy.rank_info(),
            list(self.losses),
            params,
            sharded,
            self.metrics,
            self.resumed_from,
        )
