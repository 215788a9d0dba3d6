"""Which schedules a multirank test is explored under (``--ddp-explore``, ``--ddp-schedule``,
``multirank(explore=N, schedule=SEED)``), and the folders each schedule starts from."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field

from ..schedule import format_seed, seeds


@dataclass
class Exploration:
    """The schedules of one test after its plain run, and a copy of the folders its fixtures
    made (``tmp_path``, the node folders) as they were before that run: every schedule starts
    from them as the plain run did, not from what the runs before it left there."""

    seeds: list[int]
    replay: bool  # one given seed (--ddp-schedule), not an exploration
    folders: list[str] = field(default_factory=list)
    held_seconds: float = 0.0  # the holds of the schedules run, on each one's most held rank
    _copies: list[str] = field(default_factory=list)
    _live: list[set[str]] = field(default_factory=list)  # per folder: the sockets and pipes left in place
    instead_of: int = 0  # a replay: the exploration asked for too, which it stands in for

    @classmethod
    def plan(cls, test: str, base: int, explore: int, schedule: int | None) -> Exploration | None:
        if schedule is not None:
            return cls([schedule], replay=True, instead_of=max(explore, 0))
        if explore > 0:
            return cls(seeds(base, test, explore), replay=False)
        return None

    def keep(self, folders: list[str], scratch: str) -> None:
        """Copy ``folders`` as they are now (before the plain run) into ``scratch``. A socket or
        a named pipe a fixture made there is its live end, which no copy can stand for: it is
        left where it is, through every schedule."""
        for folder in folders:
            if not os.path.isdir(folder):
                continue
            copy = tempfile.mkdtemp(prefix="schedule-start-", dir=scratch)
            shutil.copytree(folder, copy, symlinks=True, dirs_exist_ok=True, ignore=_live_ends)
            self.folders.append(folder)
            self._copies.append(copy)
            self._live.append(_live_paths(folder))

    def restore(self) -> None:
        """Put the folders back as they were before the plain run."""
        for folder, copy, live in zip(self.folders, self._copies, self._live, strict=True):
            _clear(folder, live)
            shutil.copytree(copy, folder, symlinks=True, dirs_exist_ok=True)

    def discard(self) -> None:
        for copy in self._copies:
            shutil.rmtree(copy, ignore_errors=True)
        self._copies.clear()
        self.folders.clear()
        self._live.clear()

    def header(self, index: int, seed: int) -> str:
        """The first line of a failure found under a schedule."""
        text = format_seed(seed)
        if self.replay:
            return f"failed under schedule {text} (--ddp-schedule={text}){self._instead()}"
        return f"failed under schedule {index} of {len(self.seeds)} (seed {text}); replay with --ddp-schedule={text}"

    def not_replayed(self) -> str:
        """The first line of a replay whose plain run failed: its schedule never ran."""
        return (
            f"failed in the plain run; schedule {format_seed(self.seeds[0])} was not replayed"
            " (a replay runs the test plainly first, and replays the schedule only after a pass)"
        )

    def _instead(self) -> str:
        if not self.instead_of:
            return ""
        return f"; the one schedule replayed, in place of the {self.instead_of} an exploration would run"

    def passed(self) -> str:
        held = f"; holds {self.held_seconds:.3f} s in all"
        if self.replay:
            return f"passed under schedule {format_seed(self.seeds[0])}{held}{self._instead()}"
        listed = ", ".join(map(format_seed, self.seeds))
        return f"passed under all {len(self.seeds)} schedules explored (seeds {listed}){held}"


def _is_live_end(path: str) -> bool:
    """A socket, a named pipe or a device: neither a file, a folder nor a link."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def _live_ends(folder: str, names: list[str]) -> set[str]:
    return {name for name in names if _is_live_end(os.path.join(folder, name))}


def _live_paths(folder: str) -> set[str]:
    """The live ends under ``folder``, and the folders that hold them."""
    live: set[str] = set()
    for root, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            path = os.path.join(root, name)
            if _is_live_end(path):
                while path != folder:
                    live.add(path)
                    path = os.path.dirname(path)
    return live


def _clear(folder: str, live: set[str]) -> None:
    """Remove what ``folder`` holds, but the live ends kept in place (and their folders). A
    folder the run removed (a trainer cleaning its output) is made again by the copy."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    except NotADirectoryError:  # the run put a file in its place
        os.unlink(folder)
        return
    for name in names:
        path = os.path.join(folder, name)
        if path in live:
            if os.path.isdir(path) and not os.path.islink(path):
                _clear(path, live)
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
