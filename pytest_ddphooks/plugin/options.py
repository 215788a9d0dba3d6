"""The command-line options and ini values of pytest-ddphooks, each documented where it is
defined. ``settings.Settings`` reads and checks them once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Option:
    """A command-line option and its ini twin (``flag`` "" for an ini value alone)."""

    name: str  # the ini name and the option's dest
    flag: str
    help: str
    ini_default: Any = ""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    ini_type: str | None = None  # "linelist" for a list
    store_true: bool = False
    number: type | None = None  # also a TOML number of this type (``[tool.pytest]``), besides a string


OPTIONS = (
    Option(
        "ddp_timeout",
        "--ddp-timeout",
        f"time limit of a multirank test across its ranks, in seconds (default {DEFAULT_TIMEOUT:g}); the"
        " marker's timeout wins, pytest-timeout's value for the test comes next",
        str(DEFAULT_TIMEOUT),
        metavar="SECONDS",
        number=float,
    ),
    Option(
        "ddp_leaks",
        "--ddp-leaks",
        "what a test that leaves a process group, process, thread, socket or distributed environment"
        " variable behind gets: fail (default), warn, off",
        "fail",
        choices=("fail", "warn", "off"),
    ),
    Option(
        "ddp_leaks_allow",
        "",
        "known long-lived things the leak guard ignores, one per line: thread:NAME-GLOB,"
        " process:CMDLINE-GLOB, socket:HOST:PORT-GLOB, env:NAME, group (any) or group:NAME-GLOB",
        [],
        ini_type="linelist",
    ),
    Option(
        "ddp_trace_dir",
        "--ddp-trace-dir",
        "write the recorded timeline of each failed multirank test there as Chrome trace JSON",
        metavar="DIR",
    ),
    Option(
        "ddp_report",
        "--ddp-report",
        "write one self-contained HTML page of the session's multirank tests there: outcomes, each"
        " rank's lane with its hooks and collectives, diagnoses, tracebacks and output",
        metavar="PATH.html",
    ),
    Option(
        "ddp_pdb_rank",
        "--ddp-pdb-rank",
        "with --pdb: the rank whose failure opens the debugger (default: the first rank to fail)",
        metavar="K",
        number=int,
    ),
    Option(
        "ddp_explore",
        "--ddp-explore",
        "after a multirank test passes, run it N more times, each under a different seeded schedule"
        " that holds ranks back at their recorded points; it fails at the first schedule it fails under"
        " (default 0: off; the marker's explore=N wins)",
        "0",
        metavar="N",
        number=int,
    ),
    Option(
        "ddp_schedule",
        "--ddp-schedule",
        "run each multirank test once under exactly the schedule of this seed (as a failure found by"
        " --ddp-explore names it, e.g. 0x5eed1234)",
        metavar="SEED",
        number=int,
    ),
    Option(
        "ddp_prepare",
        "--ddp-prepare",
        "set up the ranks of the next multirank test (forked, rendezvoused, group connected) while"
        " a test runs: on (default) or off; a test never sees the difference, only its start time does",
        "on",
        choices=("on", "off"),
    ),
    Option(
        "ddp_freeze_inherited",
        "--ddp-freeze-inherited",
        "ranks leave the objects they inherit from the fork server out of the collections the"
        " interpreter starts by itself (gc.freeze): on (default) or off; gc.get_objects, gc.get_referrers"
        " and gc.collect() still see the whole heap",
        "on",
        choices=("on", "off"),
    ),
    Option(
        "ddp_preload",
        "",
        "modules the rank launcher imports before it forks ranks, one per line (torch and"
        " torch.distributed always): what every rank would otherwise import anew, e.g. torch._dynamo",
        [],
        ini_type="linelist",
    ),
    Option(
        "ddp_spmd",
        "--ddp-spmd",
        "run the session on the ranks torchrun launched: auto (when torchrun's environment is there, default), on, off",
        "auto",
        choices=("auto", "on", "off"),
    ),
    Option(
        "ddp_plain_tests",
        "--ddp-plain-tests",
        "under torchrun, where plain (non-multirank) tests run: rank0 (default) or all ranks",
        "rank0",
        choices=("rank0", "all"),
    ),
    Option(
        "ddp_verbose_ranks",
        "--ddp-verbose-ranks",
        "under torchrun, let every rank print its terminal report (default: rank 0 only)",
        store_true=True,
    ),
)


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddphooks", "pytest-ddphooks (distributed hook ordering)")
    for opt in OPTIONS:
        if opt.flag:
            help_text = opt.help + f" (ini {opt.name})"
            if opt.store_true:
                group.addoption(opt.flag, dest=opt.name, action="store_true", default=False, help=help_text)
            else:
                group.addoption(
                    opt.flag, dest=opt.name, default=None, choices=opt.choices, metavar=opt.metavar, help=help_text
                )
        if opt.store_true:  # the flag, or its ini twin set to true
            parser.addini(opt.name, opt.help, type="bool", default=False)
        else:
            _add_ini_value(parser, opt)


def _add_ini_value(parser: pytest.Parser, opt: Option) -> None:
    """A string, or for a number also a TOML number: pytest 9's native TOML tables
    (``[tool.pytest]``) give numbers as numbers, an ini file gives strings. A pytest that takes
    no union of types (before 9.1) gets a string, as an ini file gives."""
    if opt.number is not None:
        try:
            parser.addini(opt.name, opt.help, type=str | opt.number, default=opt.ini_default)  # type: ignore[arg-type]
            return
        except (AssertionError, TypeError, ValueError):
            pass
    parser.addini(opt.name, opt.help, type=opt.ini_type, default=opt.ini_default)  # type: ignore[arg-type]
