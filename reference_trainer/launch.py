"""Self-launch: the trainer starts its own rank processes, as torchrun would, on loopback only.

The launcher binds a socket on 127.0.0.1 port 0 and keeps it open until the ranks are gone;
rank 0 serves the run's TCPStore from that very descriptor (``master_listen_fd``), so there
is no window in which another program could take the port, and nothing listens beyond
loopback. Every rank sees torchrun's variables with ``TORCHELASTIC_USE_AGENT_STORE``, so its
``env://`` group joins that store as a client, and runs the ordinary external lifecycle.
Ranks report through files in a private run directory: a result each, and, when recording,
the crash-safe event file of their Recorder, which the launcher merges into one Timeline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import instrument
from .results import FitResult, RankOutput
from .strategies import Strategy

if TYPE_CHECKING:
    from pytest_ddphooks import Timeline

    from .hooks import Callback, DataModule, Module

LOOPBACK = "127.0.0.1"


class Trainer(Protocol):
    """What launching ranks needs of the trainer (``reference_trainer.Trainer``)."""

    record: bool
    recorder_arg: Any
    timeout: float
    callbacks: list[Callback]
    strategy: Strategy | None
    timeline: Timeline | None
    failed_at_ns: int | None
    _caller_instrumented: bool
    _launched: bool

    def new_strategy(self) -> Strategy: ...

    def should_prepare(self, strategy: Strategy) -> bool: ...

    def prepare_data(self, module: Module, dm: DataModule | None) -> None: ...

    def fit_rank(
        self, module: Module, datamodule: DataModule | None, strategy: Strategy, event_file: str | None = None
    ) -> RankOutput: ...


class RankError(RuntimeError):
    """A rank the trainer launched failed. ``rank`` is the one that failed first (the others
    usually fail because it left); ``failures`` holds every failed rank's traceback."""

    def __init__(self, rank: int | None, text: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(text)
        self.rank = rank
        self.text = text
        self.failures = failures or {}


def rank_env(rank: int, world_size: int, num_nodes: int, port: int) -> dict[str, str]:
    local = world_size // num_nodes
    node = rank // local
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "NODE_RANK": str(node),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def launch(trainer: Trainer, module: Module, datamodule: DataModule | None, strategy: Strategy) -> FitResult:
    if trainer.recorder_arg is not None or trainer._caller_instrumented:
        raise ValueError(
            f"strategy {strategy.name!r} launches its own ranks, which cannot record into a recorder of this"
            " process: use Trainer(record=True) and read FitResult.timeline"
        )
    if strategy.launch_method is None:
        raise RuntimeError(f"strategy {strategy.name!r} does not launch ranks")
    world, nodes = strategy.world_size, strategy.num_nodes
    run_dir = tempfile.mkdtemp(prefix="reference-trainer-")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        if strategy.launch_method == "fork":
            strategy.preload()
        if strategy.prepare_data_in_launcher:
            _prepare_in_launcher(trainer, module, datamodule, world, nodes, run_dir)
        context = mp.start_processes(
            _rank_main,
            args=(world, nodes, trainer, module, datamodule, listener, run_dir),
            nprocs=world,
            join=False,
            start_method=strategy.launch_method,
        )
        _join(context, trainer.timeout + 60.0, run_dir)
        outputs = {}
        for rank in range(world):
            data = torch.load(os.path.join(run_dir, f"result-{rank}.pt"), weights_only=False)
            outputs[rank] = RankOutput(**data)
        timeline = _merged_timeline(run_dir, world) if trainer.record else None
    finally:
        listener.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    trainer.timeline = timeline
    return FitResult(outputs, timeline)


def _join(context: Any, limit: float, run_dir: str) -> None:
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within {limit:.0f} s (a hang?); they were killed")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        failures = _failures(run_dir)
        if not failures:
            raise RankError(exc.error_index, f"rank {exc.error_index} failed:\n{exc}") from None
        first = min(failures, key=lambda r: failures[r][0])
        text = f"rank {first} failed first:\n{failures[first][1]}"
        others = sorted(r for r in failures if r != first)
        for r in others:
            text += f"\nthen rank {r}: {failures[r][1].strip().splitlines()[-1]}"
        raise RankError(first, text, {r: tb for r, (_, tb) in failures.items()}) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        # torch leaves the file a failed child wrote its traceback to; ours are in run_dir
        for path in context.error_files:
            with contextlib.suppress(OSError):
                os.remove(path)


def _failures(run_dir: str) -> dict[int, tuple[int, str]]:
    """rank -> (when it failed, its traceback), from the files failed ranks left."""
    out = {}
    for name in os.listdir(run_dir):
        if name.startswith("error-"):
            with open(os.path.join(run_dir, name)) as f:
                when, _, text = f.read().partition("\n")
            out[int(name.removeprefix("error-"))] = (int(when), text)
    return out


def _prepare_in_launcher(
    trainer: Trainer, module: Module, datamodule: DataModule | None, world: int, nodes: int, run_dir: str
) -> None:
    """ddp_spawn: prepare_data here, standing in for each rank that would have prepared."""
    try:
        for rank in range(world):
            stand_in = trainer.new_strategy()
            stand_in.set_rank(rank, world, nodes)
            if not trainer.should_prepare(stand_in):
                continue
            trainer.strategy = stand_in
            module.trainer = trainer
            if datamodule is not None:
                datamodule.trainer = trainer
            rec = None
            if trainer.record:
                from pytest_ddphooks import Recorder

                rec = Recorder(rank, world, event_file=os.path.join(run_dir, f"launcher-{rank}"))
                instrument.instrument_parts(rec, module, datamodule)
            try:
                trainer.prepare_data(module, datamodule)
            finally:
                if rec is not None:
                    rec.close()  # also undoes the instrumentation, which could not be pickled
    finally:
        trainer.strategy = None
        module.trainer = None
        if datamodule is not None:
            datamodule.trainer = None


def _forget_inherited_recorders() -> None:
    """A forked rank must not write into the caller's recorder (its event file is shared)."""
    core = sys.modules.get("pytest_ddphooks.recorder.core")
    if core is None:
        return
    for _ in range(16):
        rec = core.current()
        if rec is None:
            return
        rec.close()


def _rank_main(
    rank: int,
    world: int,
    nodes: int,
    trainer: Trainer,
    module: Module,
    datamodule: DataModule | None,
    listener: socket.socket,
    run_dir: str,
) -> None:
    _forget_inherited_recorders()
    port = listener.getsockname()[1]
    os.environ.update(rank_env(rank, world, nodes, port))
    torch.set_num_threads(1)
    wait = timedelta(seconds=trainer.timeout)
    if rank == 0:
        # serves the store from the launcher's socket; the store takes the descriptor over (it
        # closes it when it goes), so the socket object must let go of it
        fd = listener.detach()
        store = dist.TCPStore(LOOPBACK, port, world, True, wait, wait_for_workers=False, master_listen_fd=fd)
    else:
        listener.close()
        store = dist.TCPStore(LOOPBACK, port, world, False, wait)
    done = f"reference_trainer/exit/{rank}"
    try:
        trainer._launched = True
        event_file = os.path.join(run_dir, f"events-{rank}") if trainer.record else None
        out = trainer.fit_rank(module, datamodule, trainer.new_strategy(), event_file=event_file)
        torch.save(out.to_dict(), os.path.join(run_dir, f"result-{rank}.pt"))
    except BaseException:
        with contextlib.suppress(Exception):
            with open(os.path.join(run_dir, f"error-{rank}"), "w") as f:
                f.write(f"{trainer.failed_at_ns or time.time_ns()}\n{traceback.format_exc()}")
            store.set(done, "failed")
        raise  # a failed rank leaves at once; the launcher stops the others
    store.set(done, "ok")
    if rank == 0:
        # rank 0 serves the store: it stays until every rank is through with the run
        with contextlib.suppress(Exception):
            store.wait([f"reference_trainer/exit/{r}" for r in range(world)], wait)


def _merged_timeline(run_dir: str, world: int) -> Any:
    from pytest_ddphooks.recorder.events import read_raw
    from pytest_ddphooks.recorder.timeline import Timeline

    raw = {}
    for rank in range(world):
        before = list(read_raw(os.path.join(run_dir, f"launcher-{rank}")))
        own = list(read_raw(os.path.join(run_dir, f"events-{rank}")))
        # call ids pair a start with its end within a rank: keep the two recorders' ids apart
        offset = max((r[0] for r in before), default=0)
        raw[rank] = before + [(r[0] + offset if r[0] else 0, *r[1:]) for r in own]
    return Timeline.from_raw(raw)
