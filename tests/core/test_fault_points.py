"""How a fault's point (``at=``) is read: the last '#' followed by digits is the count."""

from __future__ import annotations

import pytest

from pytest_ddphooks import FaultError
from pytest_ddphooks.faults import parse_point
from pytest_ddphooks.recorder import events


@pytest.mark.parametrize(
    ("at", "phase", "name", "n"),
    [
        ("dist.all_reduce#2", events.START, "dist.all_reduce", 2),
        ("start:setup", events.START, "setup", 1),
        ("end:fit#3", events.END, "fit", 3),
        ("mark:epoch#2#1", events.POINT, "epoch#2", 1),
        ("mark:phase#warmup", events.POINT, "phase#warmup", 1),
        ("end:Trainer.fit#a#4", events.END, "Trainer.fit#a", 4),
    ],
)
def test_a_point_is_its_phase_name_and_count(at: str, phase: str, name: str, n: int) -> None:
    point = parse_point(at)
    assert (point.phase, point.name, point.n) == (phase, name, n)


@pytest.mark.parametrize("at", ["dist.barrier#x", "dist.barrier#0", "mark:step#0", "dist.barrier#\u00b2"])
def test_a_count_that_is_no_number_from_one_up_is_refused(at: str) -> None:
    with pytest.raises(FaultError, match="the count after '#' must be a number >= 1"):
        parse_point(at)
