"""The markers: ``multirank`` read and checked at collection, ``special``, ``ddp_allow_leaks``.

A bad ``multirank`` marker never spawns anything and never hides the module's other tests:
the test it marks is an error at its setup that names the test and the argument (as pytest
does for a ``skipif`` whose condition cannot be evaluated), every bad marker of a module in
one run. Two ``multirank`` markers on one test, and one on a ``unittest.TestCase`` method,
are errors of the same kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ..spec import MultirankSpec, SpecError, parse_multirank
from . import rankfixtures

MULTIRANK_HELP = (
    "multirank(world_size=2, *, backend='gloo', nodes=1, timeout=None, init_process_group=True,"
    " restarts=0, explore=None, schedule=None):"
    " run the test body on world_size fresh rank processes joined in one process group"
)
SPECIAL_HELP = "special: run this test in a fresh Python interpreter of its own"


@dataclass
class MultirankRun:
    """What collection decided for one multirank item."""

    spec: MultirankSpec
    world_size: int
    dependent: list[str] = field(default_factory=list)  # fixtures evaluated inside the ranks, in order
    timeout: float | None = None  # pytest-timeout's value, when it times this test


RUN_KEY = pytest.StashKey[MultirankRun]()
TIMEOUT_KEY = pytest.StashKey[float]()  # pytest-timeout's value for a test this plugin times
THREAD_TIMEOUT_KEY = pytest.StashKey[bool]()  # ... with --timeout-method=thread
FUNC_ONLY_KEY = pytest.StashKey[bool]()  # ... with func_only: it limits only the test's call
BAD_MARKER_KEY = pytest.StashKey[str]()  # why the test's multirank marker cannot be run


def is_special(item: pytest.Item) -> bool:
    return item.get_closest_marker("special") is not None


def _closest_multirank(node: pytest.Item | pytest.Function | object) -> tuple[str, list[pytest.Mark]]:
    """The markers of the nearest node that has any (the test, its class, its module), and
    what that node is: the one marker a test runs by is the nearest one."""
    chain = node.listchain() if isinstance(node, pytest.Item) else [node]  # type: ignore[union-attr]
    for at in reversed(chain):
        own = [m for m in getattr(at, "own_markers", ()) if m.name == "multirank"]
        if own and isinstance(at, pytest.Class):
            # a class's markers include its bases': the ones it sets itself override those
            declared = [m for m in _marks_of(vars(at.obj).get("pytestmark", [])) if m.name == "multirank"]
            own = declared or own[-1:]  # else the nearest base's (the last in pytest's order)
        if own:
            kind = "module" if isinstance(at, pytest.Module) else "class" if isinstance(at, pytest.Class) else "test"
            return kind, own
    return "test", []


def nearest_multirank(node: object) -> pytest.Mark | None:
    """The multirank marker a test runs by: its own, else its class's (a subclass's own over
    its bases'), else its module's."""
    _, markers = _closest_multirank(node)
    return markers[0] if markers else None


def _marks_of(value: object) -> list[pytest.Mark]:
    marks: list[object] = value if isinstance(value, list) else [value]
    return [mark for m in marks if isinstance(mark := getattr(m, "mark", m), pytest.Mark)]


def read_spec(nodeid: str, node: object, marker: pytest.Mark) -> MultirankSpec:
    """The checked spec of a test's marker; SpecError names the test and the problem."""
    where, markers = _closest_multirank(node)
    if len(markers) > 1:
        raise SpecError(
            f"{nodeid}: @pytest.mark.multirank is given {len(markers)} times on this {where};"
            " give it once (the sizes of several runs go in one marker: world_size=[2, 4])"
        )
    try:
        return parse_multirank(marker.args, marker.kwargs)
    except SpecError as exc:
        raise SpecError(f"{nodeid}: @pytest.mark.multirank: {exc}") from None


class MarkerHooks:
    def __init__(self, spmd: bool) -> None:
        self.spmd = spmd

    @pytest.hookimpl(trylast=True)
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        marker = nearest_multirank(metafunc.definition)
        if marker is None:
            return
        try:
            spec = read_spec(metafunc.definition.nodeid, metafunc.definition, marker)
        except SpecError:
            return  # the item says why at its setup
        if spec.many and not _parametrized(metafunc.definition, "world_size"):
            if "world_size" not in metafunc.fixturenames:
                metafunc.fixturenames.append("world_size")
            metafunc.parametrize("world_size", list(spec.world_sizes), ids=[str(n) for n in spec.world_sizes])

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            special = item.get_closest_marker("special")
            if special is not None and (special.args or special.kwargs):
                given = ", ".join([*map(repr, special.args), *(f"{k}={v!r}" for k, v in special.kwargs.items())])
                item.stash[BAD_MARKER_KEY] = (
                    f"{item.nodeid}: @pytest.mark.special takes no arguments, got ({given}); a time limit goes in"
                    " @pytest.mark.multirank(timeout=...) or pytest-timeout's @pytest.mark.timeout(...)"
                )
                continue
            marker = nearest_multirank(item)
            if marker is None:
                continue
            if not isinstance(item, pytest.Function) or type(item).__name__ == "TestCaseFunction":
                kind = "a unittest.TestCase method" if type(item).__name__ == "TestCaseFunction" else "this item"
                item.stash[BAD_MARKER_KEY] = (
                    f"{item.nodeid}: @pytest.mark.multirank runs pytest test functions on the ranks, not {kind};"
                    " write it as a plain test function (or a method of a plain class)"
                )
                continue
            if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
                item.stash[BAD_MARKER_KEY] = (
                    f"{item.nodeid}: @pytest.mark.multirank cannot run a hypothesis @given test: every rank"
                    " would draw examples of its own, and their collectives would mix different data;"
                    " give the examples with @pytest.mark.parametrize, or draw them on one rank and broadcast them"
                )
                continue
            try:
                spec = read_spec(item.nodeid, item, marker)
            except SpecError as exc:
                item.stash[BAD_MARKER_KEY] = str(exc)
                continue
            size = spec.world_sizes[0]
            callspec = getattr(item, "callspec", None)
            problem = _parameter_clash(item, spec, callspec)
            if problem is not None:
                item.stash[BAD_MARKER_KEY] = problem
                continue
            if spec.many and callspec is not None and "world_size" in callspec.params:
                size = int(callspec.params["world_size"])
            dependent = rankfixtures.rank_dependent(item)
            if not self.spmd:  # under torchrun the pytest process is a rank: nothing moves
                rankfixtures.prune(item, dependent)
            item.stash[RUN_KEY] = MultirankRun(spec, size, dependent)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        problem = item.stash.get(BAD_MARKER_KEY, None)
        if problem is not None:
            pytest.fail(problem, pytrace=False)


def _parametrized(node: object, name: str) -> bool:
    """Whether the test's own ``@pytest.mark.parametrize`` markers give the argument ``name``."""
    for mark in node.iter_markers("parametrize"):  # type: ignore[attr-defined]
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def _parameter_clash(item: pytest.Item, spec: MultirankSpec, callspec: object) -> str | None:
    """Why a multirank test's parameters and its marker cannot both hold, or None."""
    many = spec.many
    clash = [n for n in ("world_size", "rank") if _parametrized(item, n)]
    if clash:
        return (
            f"{item.nodeid}: @pytest.mark.parametrize gives {' and '.join(repr(n) for n in clash)}, which a"
            " multirank test's ranks give (the fixtures rank and world_size); list the sizes in the marker"
            " (world_size=[2, 4]) and give the parameter another name"
        )
    params = getattr(callspec, "params", {})
    if "world_size" in params and params["world_size"] not in spec.world_sizes:
        # the sizes of a wider marker made this test; a nearer one (pytest.param's marks) differs
        return (
            f"{item.nodeid}: this test runs by @pytest.mark.multirank(world_size={spec.world_sizes[0]}), but a"
            f" marker of its class or module made it for world_size={params['world_size']}: give the sizes in"
            " one marker (world_size=[...]) or one size per pytest.param"
        )
    if many and "world_size" not in params:
        return (
            f"{item.nodeid}: @pytest.mark.multirank(world_size=[...]) makes one test per size where it marks the"
            " test function, its class or its module, as the module is collected; a marker added later (in"
            " pytest.param(..., marks=...), or by a hook such as pytest_collection_modifyitems) gives one size"
            " (world_size=2): one pytest.param per size"
        )
    return None


def gpus(n: int) -> str:
    """``1 GPU``, ``2 GPUs``: what an nccl test needs, in words."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"
