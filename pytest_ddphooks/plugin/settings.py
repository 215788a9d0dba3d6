"""One ``Settings`` for the session, read from the options and the ini file and checked once at
start: a bad value stops the run there (exit code 4) with one message that names the option
and the value, and no hook ever reads an option again."""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from .. import spmd
from ..leaks import Allowlist
from ..schedule import EXPLORE_UNDER_TORCHRUN, ScheduleError, parse_seed
from ..spec import MAX_EXPLORE, MAX_SECONDS
from .options import DEFAULT_TIMEOUT, OPTIONS


@dataclass(frozen=True)
class Settings:
    timeout: float = DEFAULT_TIMEOUT  # default time limit of a multirank test
    leaks: str = "fail"  # fail | warn | off
    leaks_allow: Allowlist = field(default_factory=lambda: Allowlist(singletons=True))
    trace_dir: str | None = None
    report: str | None = None  # the HTML page of the session's multirank tests
    post_mortem: bool = False  # --pdb: a failing rank opens pdb on its traceback
    pdb_rank: int | None = None  # only this rank does
    preload: tuple[str, ...] = ()
    spmd: bool = False  # the session runs on ranks torchrun launched
    plain_tests_everywhere: bool = False
    verbose_ranks: bool = False
    explore: int = 0  # schedules to explore after each multirank test passes
    schedule: int | None = None  # the one schedule to run each multirank test under
    prepare: bool = True  # set up the next multirank test's ranks while a test runs
    freeze_inherited: bool = True  # a rank's own collections skip what it inherited (launch/inherited_heap.py)

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        settings = cls(
            timeout=_timeout(config),
            leaks=_choice(config, "ddp_leaks", ("fail", "warn", "off")),
            leaks_allow=_allowlist(config),
            trace_dir=_path(config, "ddp_trace_dir"),
            report=_report_path(config),
            post_mortem=bool(getattr(config.option, "usepdb", False)),
            pdb_rank=_pdb_rank(config),
            preload=tuple(config.getini("ddp_preload")),
            spmd=_spmd_mode(config),
            plain_tests_everywhere=_choice(config, "ddp_plain_tests", ("rank0", "all")) == "all",
            verbose_ranks=bool(config.getoption("ddp_verbose_ranks")) or _ini_flag(config, "ddp_verbose_ranks"),
            explore=_explore(config),
            schedule=_schedule(config),
            prepare=_choice(config, "ddp_prepare", ("on", "off")) == "on",
            freeze_inherited=_choice(config, "ddp_freeze_inherited", ("on", "off")) == "on",
        )
        if settings.spmd and (settings.explore or settings.schedule is not None):
            flag = "--ddp-explore" if settings.explore else "--ddp-schedule"
            raise pytest.UsageError(f"{flag}: {EXPLORE_UNDER_TORCHRUN}")
        return settings

    def import_preload(self) -> None:
        """Import ini ddp_preload now, in the pytest process: the launcher forked from it has
        them, and so has every rank. (Now rather than at the fork, so that pytester's inner
        sessions, which drop what they imported, never import them a second time.)"""
        for name in self.preload:
            try:
                importlib.import_module(name)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                raise pytest.UsageError(f"ini ddp_preload: cannot import {name!r}: {why}") from None


def _value(config: pytest.Config, name: str) -> tuple[Any, str]:
    """An option's value and how the user gave it (the words of an error), the command line first."""
    flag = "--" + name.replace("_", "-")
    given = config.getoption(name)
    if given is not None:
        return given, f"{flag}={given}"
    raw = config.getini(name)
    return raw, f"ini {name} = {raw}"


def _path(config: pytest.Config, name: str) -> str | None:
    """A path as pytest reads one: from the command line relative to where pytest was run,
    from the ini file relative to that file's folder (as ``testpaths`` and ``cache_dir``)."""
    given = config.getoption(name)
    if given:
        base = config.invocation_params.dir
    else:
        given = config.getini(name)
        if not given:
            return None
        base = config.inipath.parent if config.inipath is not None else config.rootpath
    return os.path.normpath(os.path.join(base, os.path.expanduser(str(given))))


def _report_path(config: pytest.Config) -> str | None:
    path = _path(config, "ddp_report")
    if path is not None and os.path.isdir(path):
        _, where = _value(config, "ddp_report")
        raise pytest.UsageError(f"{where}: {path} is a folder; give the page a file name, such as {path}/report.html")
    return path


def _ini_flag(config: pytest.Config, name: str) -> bool:
    """The ini twin of a flag: true or false (pytest reads yes/no, on/off, 1/0 too)."""
    try:
        return bool(config.getini(name))
    except (ValueError, pytest.UsageError) as exc:  # pytest words it without the name
        raise pytest.UsageError(f"ini {name}: {exc}; use true or false") from None


def _choice(config: pytest.Config, name: str, choices: tuple[str, ...]) -> str:
    value, where = _value(config, name)
    if config.getoption(name) is None and not str(value).strip():
        value = next(o.ini_default for o in OPTIONS if o.name == name)  # ``ddp_leaks =``: as if not written
    if value not in choices:
        raise pytest.UsageError(f"{where}: use one of {', '.join(choices)}")
    return str(value)


def _timeout(config: pytest.Config) -> float:
    raw, where = _value(config, "ddp_timeout")
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise pytest.UsageError(f"{where}: not a number of seconds") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise pytest.UsageError(f"{where}: the time limit must be a number of seconds > 0 and <= {MAX_SECONDS:g}")
    return value


def _pdb_rank(config: pytest.Config) -> int | None:
    raw, where = _value(config, "ddp_pdb_rank")
    if raw in (None, ""):
        return None
    if not str(raw).strip().isdigit():
        raise pytest.UsageError(f"{where}: a rank is a whole number >= 0")
    return int(str(raw).strip())


def _allowlist(config: pytest.Config) -> Allowlist:
    try:
        return Allowlist(singletons=True).extended(config.getini("ddp_leaks_allow"))
    except ValueError as exc:
        raise pytest.UsageError(f"ini ddp_leaks_allow: {exc}") from None


def _explore(config: pytest.Config) -> int:
    raw, where = _value(config, "ddp_explore")
    text = str(raw).strip()
    if not text.isdigit() or int(text) > MAX_EXPLORE:
        raise pytest.UsageError(f"{where}: the number of schedules is an int from 0 to {MAX_EXPLORE}")
    return int(text)


def _schedule(config: pytest.Config) -> int | None:
    raw, where = _value(config, "ddp_schedule")
    if config.getoption("ddp_schedule") is not None and not str(raw).strip():
        raise pytest.UsageError(f"{where}: give the seed of the schedule to replay (an int, e.g. 0x5eed1234)")
    if raw in (None, ""):
        return None
    try:
        return parse_seed(str(raw), where)
    except ScheduleError as exc:
        raise pytest.UsageError(str(exc)) from None


def _spmd_mode(config: pytest.Config) -> bool:
    mode = _choice(config, "ddp_spmd", ("auto", "on", "off"))
    if mode == "on" and not spmd.launched():
        raise pytest.UsageError(
            "--ddp-spmd=on needs the environment torchrun gives its ranks (RANK, WORLD_SIZE, MASTER_ADDR,"
            " MASTER_PORT, TORCHELASTIC_RUN_ID): run the session under torchrun, or leave --ddp-spmd=auto"
        )
    on = mode == "on" or (mode == "auto" and spmd.launched())
    if on and (getattr(config.option, "numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER")):
        raise pytest.UsageError(
            "pytest-xdist (-n) cannot run under torchrun: every rank torchrun launched runs the whole session"
            " already; run `torchrun ... -m pytest` without -n, or pytest -n without torchrun"
        )
    return on
