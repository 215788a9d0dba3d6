"""A rank's post-mortem opens at the innermost frame of the code under test, not in a
wrapper that hides itself from tracebacks."""

from __future__ import annotations

import io

from pytest_ddphooks.launch.debugger import _PostMortem


def _hidden_wrapper() -> None:
    __tracebackhide__ = True  # as the recorder's wrappers are
    raise ConnectionError("peer went away")


def _code_under_test() -> None:
    mine = "the user's frame"
    assert mine
    _hidden_wrapper()


def _traceback() -> object:
    try:
        _code_under_test()
    except ConnectionError as exc:
        return exc.__traceback__
    raise AssertionError("did not raise")


def test_the_post_mortem_starts_at_the_code_under_test() -> None:
    out = io.StringIO()
    debugger = _PostMortem(stdin=io.StringIO("p mine\nq\n"), stdout=out)
    debugger.use_rawinput = False
    debugger.reset()
    debugger.interaction(None, _traceback())  # type: ignore[arg-type]
    shown = out.getvalue()
    assert ")_code_under_test()\n-> _hidden_wrapper()" in shown and '"the user\'s frame"' in shown, shown


def test_without_a_hidden_frame_it_starts_where_the_failure_is() -> None:
    try:
        raise KeyError("plain")
    except KeyError as exc:
        tb = exc.__traceback__
    out = io.StringIO()
    debugger = _PostMortem(stdin=io.StringIO("q\n"), stdout=out)
    debugger.use_rawinput = False
    debugger.reset()
    debugger.interaction(None, tb)
    assert ")test_without_a_hidden_frame_it_starts_where_the_failure_is()\n-> raise KeyError" in out.getvalue()
