"""The leak guard's pytest hooks: snapshot before setup, compare after teardown, clean, report.

A special test's own interpreter ends with it, as a rank process does: only a process it
started, which would outlive it, is its leak there. So does a session that a launcher
started as another rank (Lightning's DDP launcher runs the command line again for rank 1):
there a leaked process is killed with a warning, never a failure, since that launcher
takes a rank's failing exit status as the job's failure and kills every rank.

What a fixture of wider scope (module, class, package, session) creates during a test's
setup is not that test's leak: it is checked when that scope ends, and reported then in the
name of the fixture. What its teardown leaves (a process it starts, a variable it sets) is
reported in its name too, at the teardown of the test that ended the scope. Everything else
new after teardown is the test's own leak.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from .. import coverage_relay, ownership, singletons, spmd
from ..errors import LeakWarning
from ..launch import procs
from ..leaks import Allowlist, Leak, LeakGuard, Outcome, Snapshot, live_threads, native_only, thread_label
from .markers import is_special
from .session import DdpSession
from .special import runs_here

if TYPE_CHECKING:
    from _pytest.nodes import Node  # pytest does not export it

BEFORE_KEY = pytest.StashKey[Snapshot]()
WIDER_KEY = pytest.StashKey[dict[str, tuple[Any, Any]]]()  # the wider fixtures' values as teardown began
SCOPED_KEY = pytest.StashKey[list[Any]]()
AFTER_SETUP_KEY = pytest.StashKey[Snapshot]()
RANK_LEAKS_KEY = pytest.StashKey[list[Leak]]()
UNITTEST_SETUP_KEY = pytest.StashKey[Snapshot]()  # as a unittest test's setUp returned
ALLOW_KEY = pytest.StashKey["Allowlist | None"]()
ALLOW_MARKER = "ddp_allow_leaks"
ALLOW_HELP = (
    "ddp_allow_leaks(*entries): let this test leave the named things behind, e.g."
    " 'thread:worker-*', 'process:*redis*', 'group', 'socket:127.0.0.1:*', 'env:MASTER_PORT';"
    " no entries allows everything"
)


_LEAK_MARK = "_ddphooks_leak"


def _live_scopes(session: pytest.Session) -> set[Any] | None:
    """The nodes whose scope has not ended (None where pytest does not say). pytest-rerunfailures
    takes the wider scopes off pytest's stack while it reruns a failed test, to keep their
    fixtures: theirs have not ended either."""
    stack = getattr(getattr(session, "_setupstate", None), "stack", None)
    if stack is None:
        return None
    suspended = getattr(sys.modules.get("pytest_rerunfailures"), "suspended_finalizers", None) or {}
    return set(stack) | set(suspended)


def _leak_failure(message: str) -> BaseException:
    """The leak guard's failure of a test's teardown, marked so that no xfail takes it for
    the failure the test expects."""
    failure = pytest.fail.Exception(message, pytrace=False)
    setattr(failure, _LEAK_MARK, True)
    return failure


@dataclass
class _Pending:
    """Things a wider-scoped fixture made during a test's setup, checked when it ends."""

    nodes: list[Node]
    owner: str  # what made it: "fixture 'server' (module scope)", "unittest class TestX"
    test: str
    before: Snapshot
    leaks: list[Leak]


def describe(head: str, outcomes: list[Outcome], cleaned_words: str = "cleaned up before the next test") -> list[str]:
    """One line per leak under what was done: cleaned up, or left as it is and why."""
    cleaned = [o for o in outcomes if o.cleaned]
    left = [o for o in outcomes if not o.cleaned]
    lines = []
    if cleaned:
        lines.append(f"{head} ({cleaned_words}):")
        lines.extend(f"  {o.leak}" for o in cleaned)
    if left:
        lines.append(f"{head} what could not be cleaned up safely (left as it is):")
        lines.extend(f"  {o.leak}: {o.how}" for o in left)
    return lines


def _holders(item: pytest.Item) -> list[Any]:
    """Where a finished test's failure may still be kept: the item and its stash."""
    # the fixture values pytest drops right after teardown: drop them now, or what they
    # hold would be judged a leak although nothing keeps it a moment later
    if isinstance(getattr(item, "funcargs", None), dict):
        item.funcargs = {}  # type: ignore[attr-defined]
    return [item, getattr(item.stash, "_storage", {})]


class LeakHooks:
    def __init__(self, ddp: DdpSession) -> None:
        self.guard = LeakGuard(own_processes=ddp.own_processes)
        self.mode = ddp.settings.leaks
        self.allow = ddp.settings.leaks_allow
        self.pending: list[_Pending] = []
        self.allowed_processes: list[Leak] = []  # allowed leaks that still end with the session
        self.scope_ending: Snapshot | None = None  # taken as a wider scope's teardown begins
        # wider-scoped fixture (alive) -> the snapshot just before its setup: what its teardown
        # must leave as it was (undoing its setup is no leak); in the order they were set up
        self._fixture_before: dict[Any, Snapshot] = {}
        self.session_report: list[str] = []
        self.relaunched = spmd.relaunched_rank() is not None
        self.late = ddp.late_leaks  # filled by the multirank hooks as the session ends
        # wider-scoped fixture (its definition: an override is another fixture) -> what its own
        # setup made, less what fixtures it fetched inside made: of several fixtures set up for
        # one test, the one that made a thing is the one named for it, checked as its scope ends
        self._made_by: dict[Any, list[Leak]] = {}
        self._inner_made: list[list[Leak]] = []  # per fixture setup running: what nested ones made
        self._set_up: list[Any] = []  # wider fixtures set up during the current test's setup
        self.threads_left: dict[int, str] = {}  # ident of a thread a test left running -> it and the test

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Generator[None, object, object]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        module = getattr(fixturedef.func, "__module__", "") or ""
        if fixturedef.scope == "function" or module.startswith("pytest_ddphooks"):
            return (yield)
        with coverage_relay.HarnessWork():
            before = self.guard.snapshot()
        self._inner_made.append([])
        try:
            return (yield)
        finally:
            inner = self._inner_made.pop()
            with coverage_relay.HarnessWork():
                made = [lk for lk in self.guard.find(before) if not any(lk.same(m) for m in inner)]
            self._made_by[fixturedef] = made
            self._fixture_before.pop(fixturedef, None)  # set up again: last in the order
            self._fixture_before[fixturedef] = before
            self._set_up.append(fixturedef)
            if self._inner_made:  # fetched inside another fixture's setup (request.getfixturevalue)
                self._inner_made[-1].extend(inner + made)

    def _allow_for(self, item: pytest.Item) -> Allowlist | None:
        """The allowlist of one test, or None when its marker allows everything; read at its
        setup, where a bad entry fails the test before it runs."""
        if ALLOW_KEY in item.stash:
            return item.stash[ALLOW_KEY]
        allow: Allowlist | None = self.allow
        problem = None
        for mark in item.iter_markers(ALLOW_MARKER):
            unknown = sorted(k for k in mark.kwargs if k != "reason")
            if unknown:  # a misspelt call must not allow everything
                names = ", ".join(f"{k}=" for k in unknown)
                problem = (
                    f"takes the entries as positional arguments, got {names} ('env:MASTER_PORT', 'thread:worker-*')"
                )
                break
            if not mark.args:
                allow = None
                break
            try:
                allow = allow.extended(mark.args) if allow is not None else None
            except ValueError as exc:
                problem = str(exc)
                break
        # a bad marker's test is still checked against the ini's allowlist at its teardown
        item.stash[ALLOW_KEY] = allow if problem is None else self.allow
        if problem is not None:
            pytest.fail(f"{item.nodeid}: @pytest.mark.{ALLOW_MARKER}: {problem}", pytrace=False)
        return allow

    @staticmethod
    def _scoped_fixtures(item: pytest.Item) -> list[Any]:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            return []
        out = []
        for name in getattr(item, "fixturenames", ()):
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope != "function":
                out.append(defs[-1])
        return out

    @pytest.hookimpl(tryfirst=True, specname="pytest_runtest_setup")
    def pytest_runtest_setup_allow_marker(self, item: pytest.Item) -> None:
        """Inside every wrapper, before any fixture: a bad entry fails the setup of its test."""
        self._allow_for(item)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        # under "off" too: a leak is still cleaned up before the next test, only not reported
        with coverage_relay.HarnessWork():
            item.stash[BEFORE_KEY] = self.guard.snapshot()
        scoped = self._scoped_fixtures(item)
        # what the setup makes anew: a fixture never made yet, or one made again (for its
        # next parameter) holds a result it did not hold before
        had = [fd.cached_result for fd in scoped]
        self._set_up = []
        try:
            return (yield)
        finally:
            made = [fd for fd, old in zip(scoped, had, strict=True) if fd.cached_result not in (None, old)]
            # and those fetched inside fixtures (request.getfixturevalue), which the test never named
            made += [fd for fd in self._set_up if fd not in made and fd.scope != "function"]
            if made:
                item.stash[SCOPED_KEY] = made
                with coverage_relay.HarnessWork():
                    item.stash[AFTER_SETUP_KEY] = self.guard.snapshot()
                self._snapshot_when_scopes_end(item, made)

    def _snapshot_when_scopes_end(self, item: pytest.Item, fixtures: list[Any]) -> None:
        """What a wider-scoped fixture's teardown undoes (an environment variable it set, then
        removed) is no leak of the test whose teardown ended the scope: the test is judged
        on what changed until the scope began to end. Registered after the fixtures, so it
        runs before their teardown."""
        live = getattr(getattr(item.session, "_setupstate", None), "stack", None) or {}
        for node in {self._scope_node(item, fd.scope) for fd in fixtures}:
            if node in live:
                node.addfinalizer(self._scope_ends)

    def _scope_ends(self) -> None:
        if self.scope_ending is None:
            with coverage_relay.HarnessWork():
                self.scope_ending = self.guard.snapshot()

    def _scope_node(self, item: pytest.Item, scope: str) -> Node:
        kinds: dict[str, type[pytest.Collector]] = {
            "class": pytest.Class,
            "module": pytest.Module,
            "package": pytest.Package,
        }
        node = item.getparent(kinds[scope]) if scope in kinds else None
        return node if node is not None else item.session

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        case = getattr(item, "instance", None) if type(item).__name__ == "TestCaseFunction" else None
        call_setup = getattr(case, "_callSetUp", None)
        if callable(call_setup):
            # unittest runs setUp, the method and tearDown in one call: what setUp made is
            # told apart from what the method left by a look between them
            def set_up_then_look() -> None:
                call_setup()
                with coverage_relay.HarnessWork():
                    item.stash[UNITTEST_SETUP_KEY] = self.guard.snapshot()

            case._callSetUp = set_up_then_look  # type: ignore[union-attr]
        try:
            return (yield)
        finally:
            if callable(call_setup):
                # the look's closure holds the case: a case the test's item keeps for the rest of
                # the session would keep what its setUp made (a group's sockets) alive with it
                with contextlib.suppress(AttributeError):
                    del case._callSetUp  # type: ignore[union-attr]

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        item.stash[WIDER_KEY] = self._wider_values(item)
        try:
            return (yield)
        finally:
            try:
                with coverage_relay.HarnessWork(), self.guard.one_look():
                    self._check(item)
            finally:
                if WIDER_KEY in item.stash:  # the values would otherwise live as long as the session
                    del item.stash[WIDER_KEY]

    def _check(self, item: pytest.Item) -> None:
        before = item.stash.get(BEFORE_KEY, None)
        ending, self.scope_ending = self.scope_ending, None
        allow = self._allow_for(item)
        # processes a rank left: the rank's launcher has killed them already (allowed ones too:
        # a rank's processes cannot outlive it), reported unless allowed
        rank_leaks = [
            Outcome(lk, True, "killed")
            for lk in item.stash.get(RANK_LEAKS_KEY, [])
            if allow is not None and not allow.allows(lk)
        ]
        if before is None:
            self._report(item, rank_leaks, [], None)
            return
        torn_down = self._left_by_scope_teardown(item, ending)
        leaks = self.guard.find(before, ending)
        found = list(leaks)
        if self.relaunched or (is_special(item) and runs_here(item)):
            # this interpreter ends with the test: what dies with it (its groups, threads,
            # sockets, environment) is no leak; a process it started would outlive it
            leaks = [lk for lk in leaks if lk.kind == "process"]
        after_setup = item.stash.get(AFTER_SETUP_KEY, None)
        if after_setup is not None:
            made_in_setup = self.guard.find(before, after_setup)
            owned = [lk for lk in leaks if any(lk.same(m) for m in made_in_setup)]
            if owned:
                fixtures = item.stash[SCOPED_KEY]
                # each thing is the fixture's whose setup made it (one fetched inside another's
                # included); what none made alone (a thread one started for another), all of theirs
                by_owner: dict[tuple[Any, ...], list[Leak]] = {}
                for lk in owned:
                    makers = [fd for fd, made in self._made_by.items() if any(lk.same(m) for m in made)]
                    by_owner.setdefault(tuple(makers or fixtures), []).append(lk)
                for owners, theirs in by_owner.items():
                    nodes = [self._scope_node(item, fd.scope) for fd in owners]
                    owner = "fixture " + ", ".join(f"{fd.argname!r} ({fd.scope} scope)" for fd in owners)
                    self.pending.append(_Pending(nodes, owner, item.nodeid, before, theirs))
                leaks = [lk for lk in leaks if not any(lk.same(o) for o in owned)]
        if leaks:
            leaks = self._defer_what_fixtures_own(item, before, leaks)
        if leaks and type(item).__name__ == "TestCaseFunction" and item.parent is not None:
            # a unittest class keeps what setUp made for all its tests (torch's
            # MultiProcContinuousTest spawns its workers in the first setUp): judged when the
            # class ends, after tearDownClass; what the test method itself left is its own
            after_setup_method = item.stash.get(UNITTEST_SETUP_KEY, None)
            made = self.guard.find(before, after_setup_method) if after_setup_method is not None else leaks
            kept = [lk for lk in leaks if any(lk.same(m) for m in made)]
            if kept:
                owner = f"unittest class {item.parent.name} (its setUp)"
                self.pending.append(_Pending([item.parent], owner, item.nodeid, before, kept))
                leaks = [lk for lk in leaks if lk not in kept]
        own = [lk for lk in leaks if allow is not None and not allow.allows(lk)]
        if any(lk.kind == "group" for lk in leaks if lk not in own):
            # an allowed group is allowed with its connections and its store's listening socket
            own = [lk for lk in own if lk.kind != "socket"]
        # allowed to outlive its test, a process still ends with the session
        # (a library's process-wide one, its resource tracker or its reusable pool, ends with
        # the interpreter, as it does without the plugin: killing it makes the library complain)
        self.allowed_processes.extend(
            lk for lk in leaks if lk.kind == "process" and lk not in own and singletons.known(lk) is None
        )
        if own:
            assert allow is not None  # own is empty without an allowlist
            # a process what the test left running started meanwhile (a thread that started
            # it, then ended) is the test's leak as much as the thread was
            own = self.guard.settle(
                before,
                own,
                holders=_holders(item),
                newly=lambda lk: lk.kind == "process" and not any(lk.same(o) for o in found) and not allow.allows(lk),
            )
        if WIDER_KEY in item.stash:  # the values of scopes that end now go, as pytest lets them go
            del item.stash[WIDER_KEY]
        ended = self._ended_scopes(item) + torn_down
        self._report(item, rank_leaks + self.guard.clean(own, before), ended, before)

    def _left_by_scope_teardown(self, item: pytest.Item, ending: Snapshot | None) -> list[tuple[str, list[Outcome]]]:
        """What the teardown of the wider-scoped fixtures that ended with this test left behind:
        new since it began (``ending``), and not as it was before the first of them was set up
        (a variable put back, a server stopped, is no leak). Judged against that earlier state,
        and cleaned up to it."""
        ended = [fd for fd in self._fixture_before if fd.cached_result is None]
        if not ended:
            return []
        began = self._fixture_before[ended[0]]  # the first of them set up
        for fd in ended:
            del self._fixture_before[fd]
        if ending is None:  # torn down for its next parameter, or no look as its teardown began
            return []
        now = self.guard.snapshot()
        new = self.guard.find(ending, now)
        changed = {lk.key for lk in new if lk.kind == "env"}
        made = [lk for lk in new if lk.kind != "env"]
        made += [lk for lk in self.guard.find(began, now) if lk.kind == "env" and lk.key in changed]
        if self.relaunched or (is_special(item) and runs_here(item)):
            made = [lk for lk in made if lk.kind == "process"]  # the rest ends with this interpreter
        made = [lk for lk in made if not self.allow.allows(lk)]
        if not made:
            return []
        still = self.guard.settle(began, made, holders=(item,))
        if not still:
            return []
        owners = [
            f"{fd.argname!r} ({fd.scope} scope)"
            for fd in ended
            if not (getattr(fd.func, "__module__", "") or "").startswith("_pytest")
        ]
        owner = ("fixture " + ", ".join(owners)) if owners else "the teardown of the scope that ended"
        head = f"{owner}, torn down after {item.nodeid}, left behind in its teardown"
        return [(head, self.guard.clean(still, began))]

    @staticmethod
    def _wider_values(item: pytest.Item) -> dict[str, tuple[Any, Any]]:
        """The fixtures of wider scope the test used (getfixturevalue's too), with their values."""
        values = {}
        for name, fd in getattr(getattr(item, "_request", None), "_fixture_defs", {}).items():
            result = fd.cached_result
            module = getattr(fd.func, "__module__", "") or ""
            if fd.scope == "function" or result is None or result[2] is not None:
                continue
            if module.startswith(("_pytest", "pytest_ddphooks")):
                continue  # pytest's own and this plugin's fixtures own nothing of the test's
            values[name] = (fd, result[0])
        return values

    def _defer_what_fixtures_own(self, item: pytest.Item, before: Any, leaks: list[Leak]) -> list[Leak]:
        """What the value of a fixture of wider scope holds (a pool's workers started at its
        first use, a client's kept-alive connection) is the fixture's: judged when its scope
        ends, never pulled from under it. The rest is returned."""
        # taken as the teardown began: a scope that ended in it no longer holds its value
        values = item.stash.get(WIDER_KEY, None) or self._wider_values(item)
        if not values:
            return leaks
        owners = ownership.owned({name: value for name, (_, value) in values.items()}, leaks)
        taken: list[Leak] = []
        for name, found in owners.items():
            fd = values[name][0]
            mine = [lk for lk in leaks if (lk.kind, lk.ref) in found and lk not in taken]
            if mine:
                taken.extend(mine)
                owner = f"fixture {name!r} ({fd.scope} scope)"
                self.pending.append(_Pending([self._scope_node(item, fd.scope)], owner, item.nodeid, before, mine))
        return [lk for lk in leaks if lk not in taken]

    def _still(self, entry: _Pending, item: pytest.Item | None = None) -> list[Leak]:
        """What a wider-scoped fixture made and is still there, not allowed, once settled.
        The test being torn down lets go of the fixture's value first (as pytest does right
        after this teardown): what only that value kept goes with it (a group or store closes
        its sockets as it is collected); what anything else keeps (a global, a thread still
        running) stays, and is the fixture's leftover."""
        still = [lk for lk in self.guard.find(entry.before) if any(lk.same(o) for o in entry.leaks)]
        still = [lk for lk in still if not self.allow.allows(lk)]
        args = dict(getattr(item, "funcargs", None) or {})
        sockets = {lk.ref for lk in still if lk.kind == "socket"}
        if sockets and args and ownership.reaches_native_c10d(args.values()):
            # a group or a store the value holds keeps its sockets in native code: they close
            # as it is collected, which an earlier test's failure may still put off a while
            native = native_only(sockets)
            still = [lk for lk in still if not (lk.kind == "socket" and lk.ref in native)]
        return self.guard.settle(entry.before, still, holders=_holders(item) if item is not None else ())

    def _ended_scopes(self, item: pytest.Item) -> list[tuple[str, list[Outcome]]]:
        live = _live_scopes(item.session)
        out = []
        for entry in list(self.pending):
            if live is not None and any(node in live for node in entry.nodes):
                continue
            self.pending.remove(entry)
            still = self._still(entry, item)
            if still:
                head = f"{entry.owner}, set up for {entry.test}, left behind when its scope ended"
                out.append((head, self.guard.clean(still, entry.before)))
        return out

    def _report(
        self,
        item: pytest.Item,
        outcomes: list[Outcome],
        ended: list[tuple[str, list[Outcome]]],
        before: Snapshot | None,
    ) -> None:
        suspects = self._left_running(outcomes, before) if outcomes and before is not None else []
        # threads a test leaves running keep working during the tests after it
        alive = live_threads()
        for o in outcomes:
            if o.leak.kind == "thread" and not o.cleaned and o.leak.ref in alive:
                self.threads_left[o.leak.ref] = f"{thread_label(alive[o.leak.ref])}, left running by {item.nodeid}"
        for ident in [i for i in self.threads_left if i not in alive]:
            del self.threads_left[ident]
        if self.mode == "off":
            return
        lines = describe(f"{item.nodeid} leaked", outcomes)
        lines.extend(suspects)
        for head, done in ended:
            lines.extend(describe(head, done, "cleaned up"))
        if not lines:
            return
        message = "\n".join(lines)
        if self.mode == "fail" and not self.relaunched:
            raise _leak_failure(message)
        path, lineno, _ = item.reportinfo()
        try:
            warnings.warn_explicit(LeakWarning(message), LeakWarning, str(path), (lineno or 0) + 1)
        except LeakWarning:  # -W error: the test's error, in the same words
            raise _leak_failure(f"LeakWarning: {message}") from None

    def _left_running(self, outcomes: list[Outcome], before: Snapshot) -> list[str]:
        """Threads earlier tests left running that ran during this one: what the test is charged
        with may be what they did meanwhile."""
        own = {o.leak.ref for o in outcomes if o.leak.kind == "thread"}
        return [
            f"  (perhaps not this test's: {left}, still ran as this test began)"
            for ident, left in self.threads_left.items()
            if ident in before.threads and ident not in own
        ]

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report = yield
        if call.excinfo is not None and getattr(call.excinfo.value, _LEAK_MARK, False) and hasattr(report, "wasxfail"):
            # an xfail expects the test's own failure, never what it left behind
            report.outcome = "failed"
            del report.wasxfail
        return report

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.guard.clean([lk for lk in self.allowed_processes if procs.is_running(lk.ref)], Snapshot())
        self.session_report.extend(self.late)
        with self.guard.one_look():
            for entry in self.pending:
                still = self._still(entry)
                if still:
                    done = self.guard.clean(still, entry.before)
                    head = f"{entry.owner}, set up for {entry.test}, left behind at the end of the session"
                    self.session_report.extend(describe(head, done, "cleaned up"))
        self.pending.clear()
        if self.mode == "off":
            self.session_report.clear()
        if self.session_report and self.mode == "fail" and not self.relaunched and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.session_report:
            terminalreporter.section("ddphooks leak guard", sep="=")
            for line in self.session_report:
                terminalreporter.line(line)
