"""Which fixtures of a multirank test are set up where, and how values reach the ranks.

Fixtures are set up by pytest in the pytest process, as for any test, and their values are
pickled to the ranks — except the rank-local ones (``rank``, ``recorder``, ``node_tmp_path``,
``monkeypatch``) and every fixture that depends on one of them: those are pruned from the
pytest-side setup and evaluated inside each rank, once per rank per test, whatever their
declared scope (a value that differs per rank cannot be shared).
"""

from __future__ import annotations

import inspect
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from _pytest.tmpdir import TempPathFactory

from .. import coverage_relay

# what only makes sense in the process the body runs in: each rank captures, records,
# patches and collects warnings of its own
RANK_LOCAL = frozenset(
    {
        "rank",
        "world_size",
        "recorder",
        "faults",
        "restart_count",
        "node_tmp_path",
        "monkeypatch",
        "capsys",
        "capsysbinary",
        "capteesys",
        "capfd",
        "capfdbinary",
        "caplog",
        "recwarn",
        "record_property",  # what they record travels back with the rank's result
        "record_testsuite_property",
        "record_xml_attribute",
        "pytestconfig",  # the rank has the session's config and cache: nothing to send
        "cache",
    }
)
RANK_RESOLVED = RANK_LOCAL | {"request"}
# folders every rank of a test sees, made in the pytest process before the ranks start: they
# reach the ranks whenever the test's fixtures include them, even unnamed by its arguments (a
# body may ask for one by name), and a rank cannot make one of its own later (each would make
# another); the others of the kind (tmpdir, shared_tmp_path) are made from them in the rank
SHARED_FOLDERS = frozenset({"tmp_path", "tmpdir", "shared_tmp_path", "tmp_path_factory", "tmpdir_factory"})
MADE_BEFORE_THE_RANKS = frozenset({"tmp_path", "node_tmp_path", "tmp_path_factory", "tmpdir_factory"})


class FixtureNotFound(pytest.FixtureLookupError):  # type: ignore[misc]  # final for typing only
    """``request.getfixturevalue`` of a fixture that does not exist, in a rank: what pytest
    raises for it in a plain test (the optional-fixture idiom catches it), in pytest's words."""

    def __init__(self, name: str) -> None:
        self.msg = f"fixture {name!r} not found"
        Exception.__init__(self, self.msg)
        self.argname, self.request, self.fixturestack = name, None, []  # type: ignore[assignment]

    def formatrepr(self) -> Any:
        return _Words(str(self.msg))


class _Words:
    """A failure's text as pytest writes a repr to the terminal."""

    def __init__(self, text: str) -> None:
        self.text = text

    def toterminal(self, tw: Any) -> None:
        tw.line(self.text, red=True, bold=True)

    def __str__(self) -> str:
        return self.text


class FixtureNotSendable(Exception):
    def __init__(self, name: str, reason: str, what: str = "fixture", cannot: str = "be sent to the ranks") -> None:
        super().__init__(f"{what} {name!r} cannot {cannot}: {reason}")
        self.name = name
        self.reason = reason


def _kind_of(item: pytest.Function, name: str) -> str:
    """How the user knows a value: a ``parametrize`` argument, or a fixture."""
    defs = item._fixtureinfo.name2fixturedefs.get(name) or ()
    direct = any(getattr(d.func, "__name__", "") == "get_direct_param_fixture_func" for d in defs)
    return "parametrize argument" if direct else "fixture"


def _defs(item: pytest.Function, name: str) -> list[Any]:
    known = item._fixtureinfo.name2fixturedefs.get(name)
    if known is None:  # asked for by name only (``request.getfixturevalue``)
        known = item.session._fixturemanager.getfixturedefs(name, item)
    return list(known or ())


def rank_dependent(item: pytest.Function) -> list[str]:
    """Fixtures of the item that must be evaluated in the ranks, in pytest's setup order
    (autouse and ``usefixtures`` ones among them: the test does not name those)."""
    memo: dict[tuple[str, int], bool] = {}

    def depends(name: str, index: int = -1) -> bool:
        if name in RANK_LOCAL:
            return _provided(item, name)
        key = (name, index)
        if key in memo:
            return memo[key]
        memo[key] = False  # cycles cannot make a fixture rank-local
        defs = _defs(item, name)
        result = False
        if defs and -index <= len(defs):
            fd = defs[index]
            for arg in fd.argnames:
                if arg == name:
                    result = result or depends(name, index - 1)
                elif arg != "request":
                    result = result or depends(arg)
        memo[key] = result
        return result

    return [name for name in item.fixturenames if depends(name)]


def _provided(item: pytest.Function, name: str) -> bool:
    """Whether a plugin provides the fixture here (``-p no:logging`` takes ``caplog`` away:
    pytest then says it is not found, as for a plain test, before any rank starts)."""
    return name == "request" or bool(_defs(item, name))


def prune(item: pytest.Function, dependent: list[str]) -> None:
    """Keep pytest from setting up, in its own process, what the ranks will evaluate."""
    item.fixturenames = [
        n for n in item.fixturenames if n not in dependent and not (n in RANK_RESOLVED and _provided(item, n))
    ]


def needed_values(item: pytest.Function, dependent: list[str]) -> list[str]:
    """Values from the pytest process that the ranks need: test arguments and the inputs of
    the rank-evaluated fixtures."""
    wanted: list[str] = []
    seen: set[str] = set()

    def want(name: str, index: int = -1) -> None:
        key = f"{name}#{index}"
        if key in seen:
            return
        seen.add(key)
        if name in RANK_RESOLVED:
            return
        if name in dependent:
            defs = _defs(item, name)
            if defs and -index <= len(defs):
                for arg in defs[index].argnames:
                    want(name, index - 1) if arg == name else want(arg)
            return
        if name not in wanted:
            wanted.append(name)

    for name in item._fixtureinfo.argnames:
        want(name)
    for name in dependent:
        want(name)
    for name in item._fixtureinfo.names_closure:
        if name in SHARED_FOLDERS:
            want(name)
    return wanted


class _ToRanks(pickle.Pickler):
    """Pickles fixture values for the ranks; pytest's own objects that hold callbacks of the
    session travel as what a rank needs of them."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TempPathFactory:
            # the session's factory keeps its end-of-session cleanups: a rank gets one on the
            # same base folder (made here if not yet), whose numbered folders never collide
            return _factory_in_rank, (obj.getbasetemp(), obj._retention_count, obj._retention_policy)
        return NotImplemented


def _to_ranks(value: Any) -> bytes:
    buf = io.BytesIO()
    _ToRanks(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def _factory_in_rank(basetemp: Any, retention_count: int, retention_policy: Any) -> TempPathFactory:
    return TempPathFactory(None, retention_count, retention_policy, _no_trace, basetemp, _ispytest=True)


def _no_trace(*args: Any) -> None:
    pass


# fixtures that cannot serve a multirank body, wherever they are evaluated, and why
CANNOT_WORK_IN_RANKS = {
    "subtests": (
        "a sub-test reports its own outcome to the session, and a rank's reports would be lost or "
        "made once per rank; use parametrize, or assert per rank in the body"
    ),
}


def pickle_values(item: pytest.Function, names: list[str]) -> dict[str, bytes]:
    out = {}
    for name in names:
        if name in CANNOT_WORK_IN_RANKS and name in item.funcargs:
            raise FixtureNotSendable(name, CANNOT_WORK_IN_RANKS[name], cannot="work in a multirank test")
        if name not in item.funcargs:
            continue
        try:
            out[name] = _to_ranks(item.funcargs[name])
        except Exception as exc:
            raise FixtureNotSendable(name, f"{type(exc).__name__}: {exc}", _kind_of(item, name)) from None
    # the values of the autouse and usefixtures fixtures the test does not name: a plugin's
    # pytest_pyfunc_call may read them from ``item.funcargs`` (anyio's ``anyio_backend``, a
    # name or a tuple of options). Only plain data travels: anything else (a dataset, an object
    # whose pickling does work or cannot be undone in a rank) is simply absent there, as
    # nothing in the rank asks for it by name
    for name in item._fixtureinfo.initialnames:
        if name in item.funcargs and name not in out and name not in RANK_RESOLVED and _plain(item.funcargs[name]):
            out[name] = _to_ranks(item.funcargs[name])
    return out


def _plain(value: Any, budget: list[int] | None = None) -> bool:
    """None, bools, numbers, short strings and bytes, and small tuples, lists and dicts of them."""
    budget = [1000] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, (str, bytes)):
        return len(value) <= 65536
    if type(value) in (tuple, list):
        return all(_plain(v, budget) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _plain(v, budget) for k, v in value.items())
    return False


# each test class's attributes as the rank launcher's copy of the session has them (it is
# forked when they are taken): what a class fixture sets later must travel (``request.cls.x``)
_classes_at_fork: dict[type, dict[str, Any]] = {}


def remember_classes(items: list[pytest.Item]) -> None:
    _classes_at_fork.clear()
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and cls not in _classes_at_fork:
            _classes_at_fork[cls] = dict(vars(cls))


def _class_changes(item: pytest.Function) -> dict[str, Any]:
    cls = getattr(item, "cls", None)
    before = _classes_at_fork.get(cls) if cls is not None else None
    if before is None:
        return {}
    return {k: v for k, v in vars(cls).items() if k not in before or before[k] is not v}


def pickle_test_state(item: pytest.Function) -> bytes | None:
    """What fixtures set on the test's instance (``self.x``) and class (``request.cls.x``),
    for the rank's own instance and class."""
    instance = getattr(item, "instance", None)
    own = dict(getattr(instance, "__dict__", None) or {})
    shared = _class_changes(item)
    if not own and not shared:
        return None
    cls_name = getattr(getattr(item, "cls", None), "__name__", "cls")
    for where, state in (("self", own), (cls_name, shared)):
        for key, value in state.items():
            try:
                _to_ranks(value)
            except Exception as exc:
                raise FixtureNotSendable(f"{where}.{key}", f"{type(exc).__name__}: {exc}") from None
    return _to_ranks((own, shared))


def restore_test_state(item: pytest.Function, blob: bytes) -> None:
    own, shared = pickle.loads(blob)
    instance = getattr(item, "instance", None)
    if own and instance is not None:
        instance.__dict__.update(own)
    cls = getattr(item, "cls", None)
    for key, value in shared.items() if cls is not None else ():
        setattr(cls, key, value)


@dataclass
class _Shim:
    """Just enough of a FixtureRequest for fixtures evaluated in a rank."""

    node: Any
    config: Any
    fixturename: str
    instance: Any
    _finalizers: list[Callable[[], object]]
    _param: Any = None
    _has_param: bool = False
    _lookup: Callable[[str], Any] | None = None

    @property
    def param(self) -> Any:
        if not self._has_param:
            raise AttributeError(f"fixture {self.fixturename!r} is not parametrized")
        return self._param

    @property
    def function(self) -> Any:
        return getattr(self.node, "function", None)

    @property
    def cls(self) -> Any:
        return getattr(self.node, "cls", None)

    @property
    def module(self) -> Any:
        return getattr(self.node, "module", None)

    def addfinalizer(self, finalizer: Callable[[], object]) -> None:
        self._finalizers.append(finalizer)

    def getfixturevalue(self, argname: str) -> Any:
        """Another fixture's value in this rank (set up here when it is not yet)."""
        assert self._lookup is not None
        return self._lookup(argname)

    @property
    def fixturenames(self) -> list[str]:
        return list(getattr(self.node, "fixturenames", ()))

    @property
    def keywords(self) -> Any:
        return self.node.keywords

    @property
    def path(self) -> Any:
        return self.node.path

    @property
    def fspath(self) -> Any:
        return self.node.fspath

    @property
    def session(self) -> Any:
        return self.node.session

    @property
    def scope(self) -> str:
        return "function"  # set up in the rank once per test, whatever its declared scope

    @property
    def param_index(self) -> int:
        callspec = getattr(self.node, "callspec", None)
        return int(callspec.indices.get(self.fixturename, 0)) if callspec is not None else 0

    def applymarker(self, marker: Any) -> None:
        self.node.add_marker(marker)

    def __getattr__(self, name: str) -> Any:
        fixturename = self.__dict__.get("fixturename")
        if name.startswith("__") or fixturename is None:  # copy, pickle, a half-built copy
            raise AttributeError(name)
        raise AttributeError(
            f"request.{name} is not available to fixture {fixturename!r}, which is set up inside the"
            " ranks (it depends on a fixture of the rank): there request gives node, config, path, fspath, param,"
            " function, cls, module, instance, fixturenames, keywords, addfinalizer and getfixturevalue"
        )

    def raiseerror(self, msg: str | None) -> NoReturn:
        raise RuntimeError(f"fixture {self.fixturename!r} in a rank: {msg}")


class _BodyRequest:
    """The test's own ``request`` in a rank: pytest's, but a fixture asked for by name
    comes from the rank's fixtures (pytest's would take the rank for its teardown)."""

    def __init__(self, request: Any, lookup: Callable[[str], Any]) -> None:
        self._request = request
        self._lookup = lookup

    def getfixturevalue(self, argname: str) -> Any:
        return self._lookup(argname)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class RankFixtures:
    """Evaluates the rank-local and rank-dependent fixtures of one item inside a rank."""

    def __init__(
        self, item: pytest.Function, values: dict[str, Any], builtins: dict[str, Any], dependent: list[str]
    ) -> None:
        self.item = item
        self.cache: dict[tuple[str, int], Any] = {(k, -1): v for k, v in {**values, **builtins}.items()}
        self.finalizers: list[Callable[[], object]] = []
        self.dependent = dependent

    def set_base(self, name: str, value: Any) -> None:
        """The value of pytest's own definition of ``name``, which the test overrides with one
        set up here (its overrides ask for it by the same name)."""
        self.cache[(name, -len(_defs(self.item, name)))] = value

    def set_shared_folder(self, path: Path) -> None:
        """``shared_tmp_path`` where the project's ``tmp_path`` is a folder per rank: pytest's
        own one, which every rank's override starts from (unless the project overrides it too)."""
        if len(_defs(self.item, "shared_tmp_path")) == 1:
            self.cache[("shared_tmp_path", -1)] = path

    def get(self, name: str, index: int = -1) -> Any:
        key = (name, index)
        if key in self.cache:
            return self.cache[key]
        if name == "monkeypatch":
            mp = pytest.MonkeyPatch()
            self.finalizers.append(mp.undo)
            value: Any = mp
        elif name == "request":
            value = _BodyRequest(self.item._request, self.get)
        elif name in MADE_BEFORE_THE_RANKS and name not in self.dependent:
            raise LookupError(
                f"fixture {name!r} cannot be set up inside a rank (request.getfixturevalue): its folder is the"
                " one every rank of the test sees, made before the ranks start; name it as an argument of the"
                " test, or of a fixture the test uses"
            )
        else:
            value = self._evaluate(name, index)
        self.cache[key] = value
        return value

    def _evaluate(self, name: str, index: int) -> Any:
        defs = _defs(self.item, name)
        if not defs or -index > len(defs):
            raise FixtureNotFound(name)
        fd = defs[index]
        callspec = getattr(self.item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        has_param = name in params
        shim = _Shim(
            self.item,
            self.item.config,
            name,
            getattr(self.item, "instance", None),
            self.finalizers,
            params[name] if has_param else None,
            has_param,
            self.get,
        )
        kwargs = {}
        for arg in fd.argnames:
            if arg == "request":
                kwargs[arg] = shim
            elif arg == name:
                kwargs[arg] = self.get(name, index - 1)
            else:
                kwargs[arg] = self.get(arg)
        try:
            from _pytest.fixtures import resolve_fixture_function

            func = resolve_fixture_function(fd, shim)  # type: ignore[arg-type]
        except Exception:
            func = fd.func
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            pytest.fail(
                f"fixture {name!r} is async and is set up inside the ranks (it depends on a fixture of the rank),"
                " where fixtures are called directly, not through anyio or pytest-asyncio, so it would never be"
                " awaited: make it depend on nothing of the rank (it is then set up in the pytest process), or"
                " await what it makes in the test",
                pytrace=False,
            )
        if inspect.isgeneratorfunction(func):
            gen = func(**kwargs)
            with coverage_relay.user_code():
                value = next(gen)

            def finish(gen: Any = gen) -> None:
                __tracebackhide__ = True
                try:
                    next(gen)
                except StopIteration:
                    return
                raise RuntimeError(f"fixture {name!r} yielded more than once")

            self.finalizers.append(finish)
            return value
        with coverage_relay.user_code():
            return func(**kwargs)

    def funcargs(self, dependent: list[str]) -> dict[str, Any]:
        """``item.funcargs`` in the rank, as pytest fills it: the test's arguments, once every
        fixture the ranks evaluate is set up in pytest's order (an autouse one the test does
        not name too), and every other fixture value of the item the rank has."""
        for name in dependent:
            self.get(name)
        out = {name: self.get(name) for name in self.item._fixtureinfo.argnames}
        for name in self.item._fixtureinfo.names_closure:
            if name not in out and (name, -1) in self.cache:
                out[name] = self.cache[(name, -1)]
        return out

    def teardown(self) -> list[BaseException]:
        __tracebackhide__ = True  # a finalizer's error shows the fixture's frame, not this loop's
        errors: list[BaseException] = []
        while self.finalizers:
            try:
                with coverage_relay.user_code():
                    self.finalizers.pop()()
            except BaseException as exc:  # every finalizer runs, as in pytest
                errors.append(exc)
        return errors
