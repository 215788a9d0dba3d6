"""warnings.warn while a recorder exists: locations as without it, and the interpreter's own
function back once no recorder is left."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from pytest_ddphooks.recorder import Recorder, warnsite

HERE = Path(__file__).name


class Hooks:
    def deprecated(self, level: object) -> None:
        warnings.warn("old hook", DeprecationWarning, stacklevel=level)  # type: ignore[arg-type]


def site(level: object, instrumented: bool) -> tuple[str, int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder(0, 1)
        hooks = rec.instrument(Hooks()) if instrumented else Hooks()
        hooks.deprecated(level)
        line = sys._getframe().f_lineno - 1
        rec.close()
    (w,) = caught
    return Path(w.filename).name, w.lineno - line


@pytest.mark.parametrize("instrumented", [False, True])
def test_stacklevel_two_names_the_caller_through_the_recorders_wrappers(instrumented: bool) -> None:
    assert site(2, instrumented) == (HERE, 0)


@pytest.mark.parametrize("level", [1, 0, -3])
def test_stacklevel_one_and_below_name_the_warn_call_itself(level: int) -> None:
    name, _ = site(level, instrumented=True)
    assert name == HERE  # the line inside Hooks.deprecated, never the recorder's files


def test_the_interpreters_warn_is_back_once_no_recorder_is_left() -> None:
    original, holders = warnings.warn, warnsite._holders  # other tests may leave recorders open
    first, second = Recorder(0, 1), Recorder(0, 1)
    assert warnings.warn is warnsite._warn
    first.close()
    assert warnings.warn is warnsite._warn  # the second still records
    second.close()
    second.close()  # closing twice releases once
    assert warnsite._holders == holders and warnings.warn is original
    if holders == 0:
        assert warnings.warn is not warnsite._warn


def test_a_warning_turned_error_inside_the_shim_shows_the_callers_line() -> None:
    with Recorder(0, 1), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning) as err:
            Hooks().deprecated(1)
    assert err.traceback[-1].frame.code.name == "_warn" and err.traceback[-1].ishidden(err)
