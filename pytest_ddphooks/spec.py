"""The ``multirank`` marker's arguments, checked once at collection (no pytest import)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .schedule import ScheduleError, parse_seed

BACKENDS = ("gloo", "nccl")
MAX_SECONDS = 1e6  # a time limit beyond this (11.6 days) is a mistake, and inf overflows a select()
MAX_WORLD_SIZE = 1024  # every rank is a process of this machine
_KEYWORDS = ("world_size", "backend", "nodes", "timeout", "init_process_group", "restarts", "explore", "schedule")
MAX_RESTARTS = 100
MAX_EXPLORE = 10_000


class SpecError(ValueError):
    """A marker argument is wrong; the message names it."""


@dataclass(frozen=True)
class MultirankSpec:
    world_sizes: tuple[int, ...]
    backend: str = "gloo"
    nodes: int = 1
    timeout: float | None = None
    init_process_group: bool = True
    many: bool = False  # world_size was given as a list: one test item per size
    restarts: int = 0  # how many times the ranks are started again after a rank died
    explore: int | None = None  # runs under seeded schedules after a pass (None: the session's)
    schedule: int | None = None  # run once under exactly this schedule's seed


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def parse_multirank(args: Sequence[Any], kwargs: Mapping[str, Any]) -> MultirankSpec:
    """Check ``multirank(world_size=2, *, backend, nodes, timeout, init_process_group)``."""
    if len(args) > 1:
        raise SpecError(f"multirank() takes at most 1 positional argument (world_size), got {len(args)}")
    unknown = [k for k in kwargs if k not in _KEYWORDS]
    if unknown:
        raise SpecError(
            f"multirank() got an unexpected keyword argument {unknown[0]!r} (known: {', '.join(_KEYWORDS)})"
        )
    if args and "world_size" in kwargs:
        raise SpecError("multirank() got world_size both as a positional and a keyword argument")
    world_size = args[0] if args else kwargs.get("world_size", 2)
    many = isinstance(world_size, (list, tuple))
    sizes = tuple(world_size) if many else (world_size,)
    if many and not sizes:
        raise SpecError("world_size=[] is empty: give at least one size")
    for size in sizes:
        if not _is_int(size) or size < 1:
            raise SpecError(f"world_size must be an int >= 1 or a list of them, got {_describe(size)}")
        if size > MAX_WORLD_SIZE:
            raise SpecError(f"world_size={size} is more ranks than one machine runs here (at most {MAX_WORLD_SIZE})")
    if len(set(sizes)) != len(sizes):
        raise SpecError(f"world_size={list(sizes)} repeats a size")
    backend = kwargs.get("backend", "gloo")
    if backend not in BACKENDS:
        raise SpecError(f"backend={backend!r} is not supported; use one of: {', '.join(map(repr, BACKENDS))}")
    nodes = kwargs.get("nodes", 1)
    if not _is_int(nodes) or nodes < 1:
        raise SpecError(f"nodes must be an int >= 1, got {_describe(nodes)}")
    for size in sizes:
        if size % nodes:
            raise SpecError(f"world_size={size} cannot be split evenly over nodes={nodes}")
    timeout = kwargs.get("timeout")
    if timeout is not None and (
        not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0
    ):
        raise SpecError(f"timeout must be a number of seconds > 0 or None, got {_describe(timeout)}")
    # typeshed's numbers.Real declares __lt__ and __le__ only; Python reflects the comparison
    if timeout is not None and timeout > MAX_SECONDS:  # type: ignore[operator]
        raise SpecError(f"timeout={timeout!r} is more than {MAX_SECONDS:g} seconds")
    init = kwargs.get("init_process_group", True)
    if not isinstance(init, bool):
        raise SpecError(f"init_process_group must be True or False, got {_describe(init)}")
    restarts = kwargs.get("restarts", 0)
    if not _is_int(restarts) or not 0 <= restarts <= MAX_RESTARTS:
        raise SpecError(f"restarts must be an int from 0 to {MAX_RESTARTS}, got {_describe(restarts)}")
    explore = kwargs.get("explore")
    if explore is not None and not (_is_int(explore) and 0 <= explore <= MAX_EXPLORE):
        raise SpecError(f"explore must be an int from 0 to {MAX_EXPLORE} (schedules), got {_describe(explore)}")
    schedule = kwargs.get("schedule")
    if schedule is not None:
        try:
            schedule = parse_seed(schedule, "schedule")
        except ScheduleError as exc:
            raise SpecError(str(exc)) from None
    return MultirankSpec(
        tuple(int(s) for s in sizes),
        backend,
        int(nodes),
        None if timeout is None else float(timeout),
        init,
        many,
        int(restarts),
        None if explore is None else int(explore),
        schedule,
    )
