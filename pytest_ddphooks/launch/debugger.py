"""A debugger in a rank, on the pytest process's terminal.

A rank has no terminal: when it wants one (a post-mortem after its body failed under
``--pdb``, or ``breakpoint()``), it listens on a Unix socket of its run's folder and notes
``debug`` through the fork server. The pytest process then connects and relays the terminal
(``relay``): pdb's output to the screen, the user's lines to pdb, until the rank closes the
connection. Meanwhile the run's time limit stands still; the other ranks wait where they are
(in a collective with the debugged rank, most likely).
"""

from __future__ import annotations

import contextlib
import os
import pdb
import select
import socket
import sys
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import IO, Any

from ..stacks import of_harness

# the pytest process lends its terminal to one rank at a time: another rank's debugger waits
# its turn as long as that takes (the time limit stands still meanwhile, and still ends a rank
# nobody ever comes to)
ACCEPT_SECONDS: float | None = None
PROMPT = b"(Pdb) "  # what pdb writes when it waits for a line
LENT = b"\x01"  # the relay's first byte: the terminal is this rank's (a refusal closes without it)


class _Terminal:
    """A line-based stream over the relay's socket, as pdb's stdin and stdout."""

    def __init__(self, sock: socket.socket) -> None:
        self.reader: IO[str] = sock.makefile("r", encoding="utf-8", errors="replace")
        self.writer: IO[str] = sock.makefile("w", encoding="utf-8", errors="replace")

    def close(self) -> None:
        for stream in (self.writer, self.reader):
            with contextlib.suppress(OSError, ValueError):
                stream.close()


def borrow_terminal(path: str, ask: Callable[[str], None]) -> socket.socket | None:
    """Listen at ``path``, ``ask`` the process that has a terminal to come, and return the
    connection once it lent its terminal; None when it has none to lend."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(ACCEPT_SECONDS)
        ask(path)
        conn, _ = listener.accept()
    except OSError:
        return None
    finally:
        listener.close()
    conn.settimeout(None)
    try:
        lent = conn.recv(1) == LENT
    except OSError:
        lent = False
    if not lent:  # no terminal to lend (an xdist worker)
        conn.close()
        return None
    return conn


class RankDebugger:
    """Opens pdb on the terminal the pytest process lends; one session at a time. ``who``
    names the process in pdb's banner (``rank 1``)."""

    def __init__(self, path: str, ask: Callable[[str], None], who: str) -> None:
        self.path = path  # the socket the pytest process connects to
        self.who = who
        self._ask = ask  # notes the pytest process that this process wants the terminal

    def _connect(self) -> tuple[socket.socket, _Terminal] | None:
        conn = borrow_terminal(self.path, self._ask)
        return None if conn is None else (conn, _Terminal(conn))

    def post_mortem(self, exc: BaseException) -> bool:
        """pdb on a failure's traceback; returns whether a terminal was lent."""
        connected = self._connect()
        if connected is None:
            return False
        conn, term = connected
        try:
            term.writer.write(f"\n>>> {self.who}: post-mortem of its failure (q ends the test) >>>\n")
            term.writer.write("".join(traceback.format_exception_only(type(exc), exc)))
            term.writer.flush()
            debugger = _PostMortem(stdin=term.reader, stdout=term.writer)
            debugger.use_rawinput = False
            debugger.reset()
            tb: TracebackType | None = exc.__traceback__
            debugger.interaction(None, tb)
        except Exception:
            pass  # a lost terminal ends the session; the failure is reported as ever
        finally:
            term.close()
            conn.close()
        return True

    def set_trace(self, frame: FrameType | None = None) -> None:
        """``breakpoint()``: pdb from the caller's frame; continuing or quitting gives the
        terminal back."""
        connected = self._connect()
        if connected is None:
            return
        conn, term = connected
        term.writer.write(f"\n>>> {self.who}: breakpoint (c continues, q ends the test) >>>\n")
        term.writer.flush()
        debugger = _Lent(term, conn)
        debugger.set_trace(frame or sys._getframe().f_back)

    def runcall(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``--trace``: pdb from the first line of ``func``. Unlike ``pdb.runcall``, quitting
        ends the test (a ``BdbQuit`` out of the call), never passes it; with no terminal to
        lend, ``func`` just runs."""
        connected = self._connect()
        if connected is None:
            return func(*args, **kwargs)
        conn, term = connected
        term.writer.write(f"\n>>> {self.who}: --trace, at the test's first line (c continues, q ends the test) >>>\n")
        term.writer.flush()
        debugger = _Lent(term, conn)
        debugger.reset()
        sys.settrace(debugger.trace_dispatch)  # stops at the first line of the next call: func's
        try:
            return func(*args, **kwargs)
        finally:
            sys.settrace(None)
            debugger._give_back()


class _PostMortem(pdb.Pdb):
    """pdb on a failure, at the innermost frame of the code under test: a collective that
    raised as its peer went away raised inside the recorder's wrapper, which is no frame a
    user came to look at (it stays on the stack, ``down`` shows it)."""

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> Any:
        done = super().setup(f, tb)
        for index in range(len(self.stack) - 1, -1, -1):
            frame = self.stack[index][0]
            if not of_harness(frame.f_code.co_filename) and not frame.f_locals.get("__tracebackhide__"):
                if index != self.curindex:
                    self.curindex, self.curframe = index, frame
                    self.curframe_locals = frame.f_locals
                break
        return done


class _Lent(pdb.Pdb):
    """pdb that hands the terminal back once the user lets the program run again."""

    def __init__(self, term: _Terminal, conn: socket.socket) -> None:
        super().__init__(stdin=term.reader, stdout=term.writer)
        self.use_rawinput = False
        self._term, self._conn = term, conn

    def _give_back(self) -> None:
        self._term.close()
        with contextlib.suppress(OSError):
            self._conn.close()

    def set_continue(self) -> None:
        super().set_continue()
        self._give_back()

    def set_quit(self) -> None:
        super().set_quit()
        self._give_back()


def relay(path: str, stdin: IO[str], stdout: IO[str]) -> None:
    """The pytest process's side: lend the terminal to the rank listening at ``path`` until
    it closes the connection."""

    def show(data: bytes) -> None:
        stdout.write(data.decode("utf-8", errors="replace"))
        stdout.flush()

    _lend(path, stdin, lambda: stdin.readline().encode(), show)


def splice(path: str, lent: socket.socket) -> None:
    """Pass a terminal lent to this process (``lent``, from ``borrow_terminal``) on to the
    process listening at ``path``, until that one closes the connection (a special test's
    interpreter does this for its ranks: the terminal is its parent's)."""
    _lend(path, lent, lambda: lent.recv(65536), lent.sendall)


def _lend(path: str, terminal: Any, read: Callable[[], bytes], write: Callable[[bytes], None]) -> None:
    """Connect to the debugger listening at ``path`` and carry its output to ``write`` and
    what ``read`` gets from ``terminal`` to it, until it closes the connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.sendall(LENT)
    except OSError:
        sock.close()
        return
    try:
        inputs: list[Any] = [sock, terminal]
        shown = bytearray()  # the end of what the debugger wrote last: its prompt, when it waits
        while True:
            try:
                if not _carry(sock, terminal, inputs, read, write, shown):
                    return
            except KeyboardInterrupt:
                if not shown.endswith(PROMPT):
                    raise  # the rank runs (a line stepped over): Ctrl-C stops the session, as ever
                # Ctrl-C at the prompt: as pdb takes it, the session goes on (q ends it)
                write(b"\n--KeyboardInterrupt--\n" + PROMPT)
    except OSError:
        return
    finally:
        sock.close()


def _carry(
    sock: socket.socket,
    terminal: Any,
    inputs: list[Any],
    read: Callable[[], bytes],
    write: Callable[[bytes], None],
    shown: bytearray,
) -> bool:
    """One exchange between the debugger and the terminal; False once the debugger closed.
    The wait is cut in short slices: Ctrl-C's signal may land on another thread of this
    process, and only the main thread's next step of Python raises it."""
    readable, _, _ = select.select(inputs, [], [], 0.1)
    if sock in readable:
        data = sock.recv(65536)
        if not data:
            return False
        shown[:] = (bytes(shown) + data)[-len(PROMPT) :]
        write(data)
    if terminal in readable:
        line = read()
        if not line:  # the terminal closed: end the session as pdb's "q" would
            line = b"q\n"
            inputs.remove(terminal)
        shown.clear()  # a line went to the debugger: it runs until it prompts again
        sock.sendall(line)
    return True


def refuse(path: str) -> None:
    """No terminal to lend: the rank's debugger is not opened (its breakpoint is passed over)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
