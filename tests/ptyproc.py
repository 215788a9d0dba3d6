"""Run a command under a pseudo-terminal and talk to it, as a person at a terminal would."""

from __future__ import annotations

import os
import pty
import select
import signal
import time
from collections.abc import Sequence


class PtyProcess:
    def __init__(self, argv: Sequence[str], cwd: str, env: dict[str, str] | None = None) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
            try:
                os.chdir(cwd)
                os.execvpe(argv[0], list(argv), env if env is not None else dict(os.environ))
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.output = b""
        self.status: int | None = None

    def expect(self, text: str, timeout: float = 60.0, since: int = 0) -> str:
        """Read until ``text`` appears (after the first ``since`` bytes of output); returns
        everything read so far."""
        wanted = text.encode()
        deadline = time.monotonic() + timeout
        while wanted not in self.output[since:]:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(left, 0))
            if not ready:
                raise TimeoutError(f"{text!r} did not appear; the terminal shows:\n{self.text[-3000:]}")
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                raise EOFError(f"{text!r} did not appear before the end; the terminal shows:\n{self.text[-3000:]}")
            self.output += chunk
        return self.text

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\n")

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code, once the rest of the output is read."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                self.output += chunk
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                raise TimeoutError(self.text[-3000:])
        return self.status
