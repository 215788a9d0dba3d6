"""Strategies: how the ranks of a fit come to exist, find each other, and wrap the model.

A strategy object lives in one rank process and is created there by the trainer (inside
``fit``), so a test can instrument it before it sets anything up. Every strategy-level
barrier goes through ``barrier``; with no process group it returns without synchronising
anything. That is deliberate: it is how real trainers behave, and it is the bug class
(a barrier that silently does nothing) that pytest-ddphooks exists to detect.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.nn  # imported early on purpose, see below
from torch import nn

from . import bugs as B

# DDP's register_comm_hook(state, hook): hook(state, bucket) -> a future of the reduced bucket
CommHook = Callable[[Any, Any], Any]

# torch.distributed.nn binds the default group as default arguments when it is imported, and
# DDP imports it lazily: imported first while a group exists, it would keep that group (its
# gloo listener, its store connection) alive for good after destroy_process_group. Imported
# here, before any group, it binds nothing.


def group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


class Strategy:
    """One process, no process group: world size 1, rank 0."""

    name: ClassVar[str] = "base"
    distributed: ClassVar[bool] = False
    # start method when the trainer launches its own ranks; None: it never does
    launch_method: ClassVar[str | None] = None
    # whether a trainer-launched run calls prepare_data in the launching process
    prepare_data_in_launcher: ClassVar[bool] = False

    def __init__(
        self,
        *,
        num_nodes: int = 1,
        world_size: int | None = None,
        bugs: frozenset[str] = frozenset(),
        timeout: float = 300.0,
        ddp_comm_hook: CommHook | None = None,
    ) -> None:
        self.bugs = B.check(bugs)
        self.timeout = timeout
        self.ddp_comm_hook = ddp_comm_hook
        self.num_nodes = num_nodes
        self.requested_world_size = world_size
        self.global_rank = 0
        self.local_rank = 0
        self.node_rank = 0
        self.world_size = 1
        self.local_world_size = 1
        self.owns_group = False  # True once this strategy created the default group
        self.device = torch.device("cpu")
        self.read_environment()

    # -- rank information --------------------------------------------------------------------

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def set_rank(self, global_rank: int, world_size: int, num_nodes: int) -> None:
        """Fill in the rank fields for ``global_rank`` of a run of ``world_size`` on ``num_nodes``."""
        if world_size % num_nodes:
            raise ValueError(f"world_size={world_size} cannot be split evenly over num_nodes={num_nodes}")
        local = world_size // num_nodes
        self.global_rank, self.world_size, self.num_nodes = global_rank, world_size, num_nodes
        self.local_world_size = local
        self.local_rank, self.node_rank = global_rank % local, global_rank // local

    def rank_info(self) -> dict[str, int]:
        return {
            "global_rank": self.global_rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "num_nodes": self.num_nodes,
        }

    def read_environment(self) -> bool:
        """Fill in the rank fields from the process's surroundings; one process is rank 0 of 1."""
        return True

    def needs_launch(self) -> bool:
        """Whether ``fit`` must start the rank processes itself before anything else."""
        return False

    def preload(self) -> None:
        """Import what ``wrap_model`` imports lazily, so forked ranks inherit it ready."""

    # -- the lifecycle -----------------------------------------------------------------------

    def setup_environment(self) -> None:
        """Join (or create) the process group; for one process there is nothing to join."""
        if self.requested_world_size not in (None, 1) or self.num_nodes != 1:
            raise ValueError(f"strategy {self.name!r} runs one process: world_size and num_nodes must be 1")

    def create_group(self) -> None:
        """Nothing to create for one process."""

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank; a no-op when no process group exists (see the module docstring)."""
        if group_exists():
            dist.barrier()

    def model_to_device(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if B.MODEL_TO_DEVICE_TWICE in self.bugs:
            model = self.model_to_device(model)  # BUG model_to_device_twice: the trainer already did
        return self._wrap(model)

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def save_checkpoint(self, state: dict[str, Any], path: Path) -> None:
        """Global rank 0 writes the checkpoint; the others have nothing to write."""
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Every rank reads the whole checkpoint (a folder every rank sees)."""
        state: dict[str, Any] = torch.load(path, weights_only=True)
        return state

    def teardown(self) -> None:
        """Release what setup_environment made."""


class SingleStrategy(Strategy):
    """One process, no group: every barrier is a no-op by design."""

    name = "single"


class DistributedStrategy(Strategy):
    """Ranks that already exist; reads them from torchrun-style variables and joins with gloo.

    The default group is created in ``setup_environment`` through ``env://`` unless one already
    exists, in which case it is used and left alone at teardown.
    """

    distributed = True
    wraps_with_ddp: ClassVar[bool] = True  # ``ddp_comm_hook`` applies

    def read_environment(self) -> bool:
        """Take the rank fields from RANK/WORLD_SIZE/... or from an existing group; False if neither."""
        env = os.environ
        if "RANK" in env:
            rank, world = int(env["RANK"]), int(env.get("WORLD_SIZE", "1"))
            local_world = int(env.get("LOCAL_WORLD_SIZE", world // self.num_nodes))
        elif group_exists():
            rank, world = dist.get_rank(), dist.get_world_size()
            local_world = int(env.get("LOCAL_WORLD_SIZE", world // self.num_nodes))
        else:
            return False
        if self.requested_world_size is not None and self.requested_world_size != world:
            raise ValueError(f"world_size={self.requested_world_size} was asked for, but the launched run has {world}")
        self.set_rank(rank, world, max(1, world // max(1, local_world)))
        # the launcher's word wins over the arithmetic when it gives one
        self.local_rank = int(env.get("LOCAL_RANK", self.local_rank))
        self.node_rank = int(env.get("NODE_RANK", env.get("GROUP_RANK", self.node_rank)))
        return True

    def setup_environment(self) -> None:
        if not self.read_environment():
            raise RuntimeError(
                f"strategy {self.name!r}: no RANK variable and no process group; start the processes with"
                " torchrun (or a harness setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
            )
        if B.GROUP_AFTER_PREPARE_DATA in self.bugs:
            return  # BUG group_after_prepare_data: the trainer calls create_group() after setup
        self.create_group()

    def create_group(self) -> None:
        if group_exists():
            if dist.get_world_size() != self.world_size:
                raise RuntimeError(f"the existing group has {dist.get_world_size()} ranks, expected {self.world_size}")
            return
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=self.timeout))
        self.owns_group = True

    def preload(self) -> None:
        importlib.import_module("torch._dynamo")  # DDP's constructor imports it: about a second

    def _wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if self.ddp_comm_hook is not None:
            ddp.register_comm_hook(None, self.ddp_comm_hook)
        return ddp

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def teardown(self) -> None:
        if self.owns_group and group_exists():
            if B.TEARDOWN_KEEPS_GROUP in self.bugs:
                return  # BUG teardown_keeps_group: the group this trainer created outlives the fit
            dist.destroy_process_group()
        self.owns_group = False


class ExternalStrategy(DistributedStrategy):
    """Processes an outside launcher started (torchrun, a test harness); wraps with DDP."""

    name = "external"


class DDPStrategy(DistributedStrategy):
    """DDP. Launches its own ranks by forking, unless they already exist (a group, or RANK set).

    A trainer-launched rank runs exactly the external lifecycle: the launcher only provides the
    processes, the variables and a loopback store, as torchrun would.
    """

    name = "ddp"
    launch_method = "fork"

    def needs_launch(self) -> bool:
        return not group_exists() and "RANK" not in os.environ

    def read_environment(self) -> bool:
        found = super().read_environment()
        if not found:
            # not launched yet: the ranks to come
            self.set_rank(0, self.requested_world_size or 2, self.num_nodes)
        return found


class DDPSpawnStrategy(DDPStrategy):
    """DDP whose ranks are fresh interpreters: the module, datamodule and trainer are pickled in.

    Order difference from ``ddp`` (trainer-launched runs only): ``prepare_data`` runs in the
    launching process, before any rank exists, once for each rank that would have prepared
    (local rank 0 of each node, or global rank 0) with the trainer reporting that rank's ranks;
    the ranks then skip it. So prepare_data is ordered before every ``setup`` by the launch
    itself, and what it sets on the module is pickled into the ranks (under ``ddp`` it would
    stay in rank 0). Recorded, those prepare_data calls open the timeline of the rank they
    stood in for. Already-launched runs (a group, or RANK set) behave exactly like ``ddp``.
    """

    name = "ddp_spawn"
    launch_method = "spawn"
    prepare_data_in_launcher = True


class FSDPStrategy(DDPStrategy):
    """FSDP2 (``fully_shard``) over gloo on CPU; launches like ``ddp``.

    Each submodule holding parameters is sharded on its own, then the root: parameters become
    DTensors sharded on dim 0, so the group must exist before ``wrap_model``. After an
    in-process fit the module's network still holds its DeviceMesh (and so the destroyed
    group's sockets) in reference cycles, until the module is garbage-collected.
    """

    name = "fsdp"
    wraps_with_ddp = False

    def preload(self) -> None:
        super().preload()
        importlib.import_module("torch.distributed.fsdp")
        importlib.import_module("torch.distributed.tensor")

    def _wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for sub in list(model.modules())[1:]:
            if any(True for _ in sub.parameters(recurse=False)):
                fully_shard(sub)
        fully_shard(model)
        return model

    def teardown(self) -> None:
        if self.owns_group:
            _forget_meshes()
        super().teardown()


def _forget_meshes() -> None:
    """Empty DTensor's sharding caches, whose entries hold the DeviceMesh and through it the
    group: without this a destroyed group's sockets stay open for the life of the process.
    Private torch API, so whatever is missing in another version is skipped."""
    import contextlib

    from torch.distributed.tensor import DTensor

    with contextlib.suppress(AttributeError):
        torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own cache
    propagator = DTensor._op_dispatcher.sharding_propagator
    with contextlib.suppress(AttributeError):
        propagator.propagate_op_sharding.cache_clear()
    with contextlib.suppress(AttributeError):
        type(propagator)._propagate_tensor_meta_cached.cache_clear()
    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

        clear_redistribute_planner_cache()


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SingleStrategy, ExternalStrategy, DDPStrategy, DDPSpawnStrategy, FSDPStrategy)
}


def strategy_class(which: str | type[Strategy], ddp_comm_hook: CommHook | None = None) -> type[Strategy]:
    """The strategy ``which`` names; an error for an unknown one, or a comm hook it cannot use."""
    cls = STRATEGIES.get(which) if isinstance(which, str) else which
    if cls is None:
        raise ValueError(f"unknown strategy {which!r}; known: {', '.join(STRATEGIES)}")
    if ddp_comm_hook is not None and not (issubclass(cls, DistributedStrategy) and cls.wraps_with_ddp):
        raise ValueError(f"ddp_comm_hook: strategy {cls.name!r} does not wrap the model in DDP")
    return cls


def make_strategy(
    which: str | type[Strategy],
    *,
    num_nodes: int = 1,
    world_size: int | None = None,
    bugs: frozenset[str] = frozenset(),
    timeout: float = 300.0,
    ddp_comm_hook: CommHook | None = None,
) -> Strategy:
    cls = strategy_class(which, ddp_comm_hook)
    return cls(num_nodes=num_nodes, world_size=world_size, bugs=bugs, timeout=timeout, ddp_comm_hook=ddp_comm_hook)
