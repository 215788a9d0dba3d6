"""Coverage of the code that runs in ranks, special tests' interpreters and what they start.

When the session measures coverage (pytest-cov's ``--cov``, or ``coverage run -m pytest``),
every process the plugin starts measures itself with the same configuration and writes a
data file of its own into the session's folder; at the end of the test loop they are
combined into the session's own measurements, before pytest-cov (or ``coverage run``) saves
and reports them. Nothing needs configuring:

- a forked rank stops the measurement it inherited (its data would be the parent's) and
  resumes the one the fork server started and paused for it while the test's own code runs;
  its lines go to the pytest process with its result (a rank killed by the watchdog loses
  its own);
- a new interpreter (a special test, a rank the code under test spawns) starts measuring
  through coverage's own start-up hook (``COVERAGE_PROCESS_CONFIG``, read by the ``.pth``
  file coverage installs) and saves at exit;
- processes those fork and leave with ``os._exit`` save too (coverage's ``fork`` and
  ``_exit`` patches, in coverage 7.10 and later).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ENV = "COVERAGE_PROCESS_CONFIG"
CONTEXT_ENV = "DDPHOOKS_COV_CONTEXT"  # "test": measure each phase of a test in its own context


_switched = False  # this process measured phases in contexts of their own: its data has them


def switch_to_test_context(nodeid: str, when: str) -> None:
    """In a special test's interpreter or a rank under ``--cov-context=test``: what follows is
    measured in the context pytest-cov gives that phase of the test (``nodeid|run`` for its
    call)."""
    global _switched
    cov = measuring()
    if cov is not None and os.environ.get(CONTEXT_ENV) == "test":
        with contextlib.suppress(Exception):
            cov.switch_context(f"{nodeid}|{'run' if when == 'call' else when}")
            _switched = True


def _coverage() -> Any | None:
    return sys.modules.get("coverage")


def measuring() -> Any | None:
    """The Coverage object measuring this process, if any."""
    coverage = _coverage()
    return coverage.Coverage.current() if coverage is not None else None


class HarnessWork:
    """The harness's own work in the pytest process is not measured, as in ranks, where only
    the test is: this thread's tracer is paused on entry and resumed on exit, at the same
    depth of the stack (so the tracer's own stack of frames stays as it was)."""

    def __init__(self) -> None:
        self._paused: Any = None

    def __enter__(self) -> None:
        tracer = sys.gettrace()
        if type(tracer).__name__ == "CTracer" and measuring() is not None:
            tracer.stop()  # type: ignore[union-attr]
            self._paused = tracer

    def __exit__(self, *exc: object) -> None:
        if self._paused is not None:
            self._paused.start()
            self._paused = None


def child_config(folder: str) -> str | None:
    """The configuration every process the plugin starts measures with: the session's own,
    writing parallel data files into ``folder``; None when nothing is measured."""
    cov = measuring()
    if cov is None:
        return None
    from coverage.config import CoverageConfig

    config = CoverageConfig.deserialize(cov.config.serialize())
    config.data_file = os.path.join(folder, os.path.basename(cov.config.data_file))
    config.parallel = True
    if hasattr(config, "patch"):
        config.patch = sorted({*config.patch, "_exit", "fork"} - {"subprocess", "execv"})
    return str(config.serialize())


_session_form: tuple[str, bool] | None = None  # the pytest process's tracer, in a forked process


def stop_inherited() -> None:
    """In the fork server, and in a freshly forked rank: stop the session's measurement
    inherited from the parent (its data is the parent's, never written from here)."""
    global _session_form
    cov = measuring()
    if cov is not None and cov is not _prepared:
        with contextlib.suppress(Exception):
            _session_form = _session_form or _form(cov)
            cov._auto_save = False
            cov.stop()


_prepared: Any | None = None  # started and paused once in the fork server: a rank resumes it
_in_rank = False  # this process is a rank that measures with ``_prepared``


def prepare(config: str) -> None:
    """In the fork server: start a measurement with the ranks' configuration and pause it at
    once. A rank forked from here only resumes it around its test's code: what starting one
    costs (finding what to measure, the tracer, coverage's patches) is paid once here
    instead of in every rank, where each first write to memory shared with this process
    is a page copied."""
    global _prepared
    if _coverage() is None:
        return
    import coverage

    cov = None
    try:
        cov = coverage.Coverage(config_file=coverage.control.CONFIG_DATA_PREFIX + config)
        patches = list(getattr(cov.config, "patch", []))
        cov.config.patch = []  # not here: forked test processes are handled by _after_fork
        for quiet in ("_warn_no_data", "_warn_unimported_source", "_warn_preimported_source"):
            setattr(cov, quiet, False)
        cov._auto_save = False
        cov.start()
        assert cov._collector is not None  # start() made it
        cov._collector.pause()
        cov._collector.data.clear()  # the few lines of this function, were they measured
        cov.config.patch = patches
    except Exception:
        if cov is not None:
            stop(cov)  # never left measuring the fork server
        return  # ranks start their own, the slower way
    _prepared = cov
    _decide_loaded_files(cov)
    if "fork" in patches:
        os.register_at_fork(after_in_child=_after_fork)


def _after_fork() -> None:
    """In every process forked from the fork server or a rank: a process the test forked in
    its rank measures itself as coverage's ``fork`` patch has it (a fresh measurement saved
    at its exit); a rank or the fork server's helpers do nothing here."""
    if _in_rank:
        with contextlib.suppress(Exception):
            from coverage.control import _after_fork_in_child

            _after_fork_in_child()


class _ModuleFrame:
    """What coverage reads of a frame to decide on its file: the module's globals."""

    def __init__(self, module: Any) -> None:
        self.f_globals = vars(module)


def _decide_loaded_files(cov: Any) -> None:
    """Decide here, once, whether each module already loaded is measured: a rank would
    otherwise decide again for every file its test touches (~50 us each, ~40 files a test).
    The decision is coverage's own, keyed as its tracer keys it (the code's file name,
    which for a module loaded from source is its ``__file__``). For coverage's C tracer a
    file not measured is cached as None, which it reads as "not traced" without touching
    an object of its own (each would be a page copied in every rank)."""
    try:
        cache = cov._collector.should_trace_cache
        decide = cov._should_trace
        c_tracer = cov._collector.tracer_name() == "CTracer"
    except AttributeError:
        return
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if not isinstance(filename, str) or not filename.endswith(".py") or filename in cache:
            continue
        with contextlib.suppress(Exception):
            disposition = decide(filename, _ModuleFrame(module))
            cache[filename] = None if c_tracer and not disposition.trace else disposition


class RankMeasurement:
    """A rank's measurement of its test: running while the test's own code runs (fixtures,
    body, finalizers), not while the harness sets the test up or reports it.

    Inside ``test_code()`` the measurement is started, but the rank's main thread is traced
    only within ``user_code()`` (a fixture's function, the body's call, a finalizer): with a
    trace function set, Python 3.11 runs every line of every frame slower, traced file or not
    (3 to 4 times, measured), and the harness's own work between them (its fixture
    resolution, its notes, the reports) is most of a trivial test's rank."""

    def __init__(self) -> None:
        global _in_rank
        self.cov = _rank_coverage()
        self._resumes = self.cov is not None and self.cov is _prepared
        _in_rank = _in_rank or self._resumes

    @contextlib.contextmanager
    def test_code(self) -> Iterator[None]:
        global _sections
        cov = self.cov
        started = False
        if cov is not None:
            with contextlib.suppress(Exception):
                if self._resumes:
                    cov._collector.resume()
                else:
                    cov.start()
                started = True
        if started:
            _sections = _UserCode.around_tracer()
        try:
            yield
        finally:
            _sections = None  # the measurement pauses the tracer, stopped or not
            if started:
                assert cov is not None  # started only when there is one
                if self._resumes:
                    with contextlib.suppress(Exception):
                        cov._collector.pause()
                else:
                    stop(cov)


class _UserCode:
    """The main thread's coverage tracer, stopped while the harness works inside a rank's
    ``test_code()`` and started while the test's own code runs (``user_code()``, which nests).

    Started in ``__enter__`` and stopped in ``__exit__``: the tracer never sees the call of
    ``__enter__`` and sees its return, then sees the call of ``__exit__`` and never its return,
    so its own stack of frames is as it was (what ``HarnessWork`` does the other way round).
    That holds only while nobody else takes the thread's trace function: once another tracer
    replaced or cleared it inside the test's code (pdb at a ``breakpoint()``), the tracer's
    stack no longer matches the frames, and started again it would write the harness's lines
    into the test's files; it is then left alone for the rest of the rank, as pdb leaves it."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.thread = threading.get_ident()
        self.depth = 0
        self.lost = False

    @classmethod
    def around_tracer(cls) -> _UserCode | None:
        """Stop this thread's tracer, if it is coverage's C tracer (any other is left running:
        everything is measured then, as before)."""
        tracer = sys.gettrace()
        if type(tracer).__name__ != "CTracer":
            return None
        tracer.stop()  # type: ignore[union-attr]
        return cls(tracer)

    def __enter__(self) -> None:
        if threading.get_ident() != self.thread:
            return  # another thread's tracer is coverage's own, started with the thread
        self.depth += 1
        if self.depth == 1 and not self.lost:
            if sys.gettrace() is not None:  # someone else's (a debugger stepping out of the test's code)
                self.lost = True
            else:
                self.tracer.start()

    def __exit__(self, *exc: object) -> None:
        if threading.get_ident() != self.thread:
            return
        self.depth -= 1
        if self.depth == 0 and not self.lost:
            if id(sys.gettrace()) == id(self.tracer):  # (an ``is`` would narrow the tracer's type)
                self.tracer.stop()
            else:  # replaced or cleared inside the test's code: never started again
                self.lost = True


_sections: _UserCode | None = None  # a rank's, while its test_code() runs under a C tracer


def user_code() -> contextlib.AbstractContextManager[Any]:
    """Where the test's own code runs inside a rank (a fixture's function, the body, a
    finalizer): measured there, and only there, when the session measures coverage."""
    return _sections if _sections is not None else _NOTHING


_NOTHING = contextlib.nullcontext()


def _rank_coverage() -> Any | None:
    """The measurement a rank runs, not started yet (None when nothing is measured); the
    one it inherited was stopped as the rank was set up."""
    if ENV not in os.environ or _coverage() is None:
        return None
    import coverage

    if _prepared is not None:
        return _prepared
    try:
        try:
            cov = coverage.process_startup(force=True)
        except TypeError:  # a coverage older than 7.10
            cov = coverage.process_startup()
    except Exception:
        return None
    stop(cov)  # it starts measuring at once; the rank starts it around the test's code
    return cov


def stop(cov: Any | None) -> None:
    """End a rank's measurement: what runs after its test is not measured."""
    if cov is not None:
        with contextlib.suppress(Exception):
            cov.stop()


@dataclass
class Measured:
    """What a rank measured, in the form the session's own tracer keeps it: merged into the
    session's live measurements as if the rank's lines had run in the pytest process."""

    tracer: str
    branch: bool
    data: dict[str, set[Any]]  # file name -> lines (or arcs, packed as the tracer packs them)
    file_tracers: dict[str, str]


def _form(cov: Any) -> tuple[str, bool] | None:
    collector = getattr(cov, "_collector", None)
    if collector is None:
        return None
    return collector.tracer_name(), bool(collector.branch)


def measured_by(cov: Any | None) -> Measured | None:
    """A rank's stopped measurement, when the pytest process can take it as it is; None
    when it must be saved to a file instead (dynamic contexts, or a different tracer)."""
    if cov is None:
        return None
    try:
        form = _form(cov)
        # merged in the pytest process, the lines would all take its context of the moment
        if form is None or form != _session_form or cov.config.dynamic_context or _switched:
            return None
        collector = cov._collector
        data = {name: set(found) for name, found in collector.data.items() if found}
        return Measured(form[0], form[1], data, dict(collector.file_tracers))
    except Exception:
        return None


def merge_into_session(measured: Measured | None) -> bool:
    """Add what a rank measured to this process's live measurements (the current dynamic
    context, if any, is the test's: as for a plain test)."""
    cov = measuring()
    if measured is None or cov is None:
        return False
    if _form(cov) != (measured.tracer, measured.branch):
        return False
    collector = cov._collector
    for name, found in measured.data.items():
        collector.data.setdefault(name, set()).update(found)
    collector.file_tracers.update(measured.file_tracers)
    return True


def save(cov: Any | None) -> None:
    """Write a rank's measurements (a rank ends with ``os._exit``: nothing else would)."""
    if cov is None:
        return
    with contextlib.suppress(Exception):
        cov.stop()
        cov.save()


def take_session() -> bytes | None:
    """Stop this process's measurement and hand it over as bytes, its data file removed
    (under torchrun: a rank's session, which rank 0 reports)."""
    cov = measuring()
    if cov is None:
        return None
    cov.stop()
    data = cov.get_data()
    blob: bytes = data.dumps()
    data.erase()
    return blob


def merge_taken(blob: bytes) -> None:
    """Add what ``take_session`` handed over in another process to this one's measurements."""
    cov = measuring()
    if cov is None or not blob:
        return
    from coverage import CoverageData

    other = CoverageData(no_disk=True)
    other.loads(blob)
    cov.get_data().update(other)


def combine_into_session(folder: str) -> int:
    """Combine the data files of the processes the plugin started into this process's own
    measurements; returns how many files there were."""
    cov = measuring()
    if cov is None:
        return 0
    found = glob.glob(os.path.join(folder, os.path.basename(cov.config.data_file) + ".*"))
    if found:
        # coverage's "Combined N files" would land in pytest's progress line: the user never
        # asked for a combine, this is the harness's own bookkeeping
        said = getattr(cov, "_messages", None)
        if said is not None:
            cov._messages = False
        try:
            cov.combine(data_paths=found, keep=False)
        finally:
            if said is not None:
                cov._messages = said
    return len(found)
