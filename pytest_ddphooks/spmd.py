"""SPMD mode: the whole pytest session runs on every rank an outside launcher (torchrun) started.

The ranks coordinate through the launcher's own key-value store, never through collectives:
a store call has a time limit, a collective on a broken group may not. They check that they
collected the same tests, agree to start each multirank test, and exchange each rank's
result and recorded events, so that every rank reaches the same verdict and rank 0 can
report it. The default process group is created once for the session and re-created after a
test that may have broken it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import blobs
from .failure import ranks_words
from .launch.rendezvous import no_reverse_lookups
from .recorder.timeline import Mismatch

ENV_MARKERS = ("TORCHELASTIC_RUN_ID",)
# this rank's own stderr, kept before pytest captures it: what must reach the user even from
# inside a captured test (a hang report just before the rank ends the run)
_REAL_STDERR = os.dup(2)
os.set_inheritable(_REAL_STDERR, False)


def launched() -> bool:
    """True in a process started by torchrun (its elastic agent sets TORCHELASTIC_RUN_ID)."""
    return all(name in os.environ for name in (*ENV_MARKERS, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def relaunched_rank() -> int | None:
    """This session's rank when a launcher other than torchrun started it as another rank of
    a job (Lightning's DDP launcher runs the command line again with LOCAL_RANK=1), else None."""
    if launched():
        return None
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


class RanksMissing(Exception):
    def __init__(self, what: str, missing: list[int], waited: float) -> None:
        who = ", ".join(str(r) for r in missing)
        super().__init__(
            f"rank{'s' if len(missing) > 1 else ''} {who} did not {what} within {waited:g} s (hung or dead)"
        )
        self.missing = missing


class RankHung(Exception):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(text)
        self.rank = rank
        self.text = text


@dataclass
class HangPost:
    """What a rank whose watchdog fired says of itself, through the store."""

    text: str  # where it is stuck, with its stack
    blocked: list[tuple[str, int, str, list[int] | None]] = field(default_factory=list)  # (group, seq, op, members)
    entered: dict[str, int] = field(default_factory=dict)  # group -> the last collective's seq it entered
    # per blocked collective: (group, seq, what must match on every member, the call as a desync
    # report prints it)
    calls: list[tuple[str, int, str, str]] = field(default_factory=list)
    output: list[tuple[str, str]] = field(default_factory=list)  # ("stdout"/"stderr", what the test printed)

    def dumps(self) -> bytes:
        raw = {
            "text": self.text,
            "blocked": self.blocked,
            "entered": self.entered,
            "calls": self.calls,
            "output": self.output,
        }
        return json.dumps(raw).encode()

    @staticmethod
    def loads(data: bytes) -> HangPost:
        try:
            raw = json.loads(data)
            blocked = [
                (str(g), int(s), str(op), None if m is None else [int(x) for x in m]) for g, s, op, m in raw["blocked"]
            ]
            entered = {str(k): int(v) for k, v in raw["entered"].items()}
            calls = [(str(g), int(s), str(same), str(call)) for g, s, same, call in raw.get("calls", [])]
            output = [(str(k), str(v)) for k, v in raw.get("output", [])]
            return HangPost(str(raw["text"]), blocked, entered, calls, output)
        except (ValueError, KeyError, TypeError):
            return HangPost(data.decode("utf-8", "replace"))


def who_never_entered(posts: dict[int, HangPost], world_size: int) -> list[str]:
    """For each collective a hung rank is blocked in: the members that never entered it, and
    the ranks that said nothing at all (stuck in native code, or gone)."""
    lines = []
    seen: set[tuple[str, int]] = set()
    for _, post in sorted(posts.items()):
        for group, seq, op, members in post.blocked:
            if (group, seq) in seen:
                continue
            seen.add((group, seq))
            ranks = members if members is not None else list(range(world_size))
            waiting = [r for r in ranks if r in posts and any((g, s) == (group, seq) for g, s, *_ in posts[r].blocked)]
            behind = [r for r in ranks if r in posts and posts[r].entered.get(group, 0) < seq]
            if behind:
                wait = "waits" if len(waiting) == 1 else "wait"
                lines.append(
                    f"{op} #{seq} on group {group}: {ranks_words(waiting)} {wait} in it,"
                    f" {ranks_words(behind)} never entered it"
                )
    silent = [r for r in range(world_size) if r not in posts]
    if silent:
        lines.append(f"{ranks_words(silent)} said nothing (stuck in native code that holds the GIL, or gone)")
    return lines


def desyncs(posts: dict[int, HangPost]) -> list[Mismatch]:
    """Per group, the first collective its hung members are inside with calls that can never
    match (what the backend checks differs), as the harness's own runs say a desync."""
    at: dict[tuple[str, int], dict[int, tuple[str, str]]] = {}
    for rank, post in posts.items():
        for group, seq, same, call in post.calls:
            at.setdefault((group, seq), {})[rank] = (same, call)
    members = {(g, s): m for post in posts.values() for g, s, _, m in post.blocked}
    out: list[Mismatch] = []
    reported: set[str] = set()
    for group, seq in sorted(at, key=lambda k: (k[1], k[0])):
        inside = at[(group, seq)]
        if group in reported or len({same for same, _ in inside.values()}) < 2:
            continue
        reported.add(group)
        ranks = members.get((group, seq)) or sorted(posts)
        calls: dict[int, str | None] = {r: None for r in ranks}
        calls.update({r: call for r, (_, call) in inside.items()})
        out.append(Mismatch(group, seq, calls, tuple(ranks)))
    return out


class Coordinator:
    """Store-based agreement between the launched ranks of one session."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._calls: dict[str, int] = {}

    @classmethod
    def from_env(cls, timeout: float) -> Coordinator:
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        wait = timedelta(seconds=timeout)
        with no_reverse_lookups(host):
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = dist.TCPStore(host, port, world, False, wait)
            else:
                store = dist.TCPStore(host, port, world, rank == 0, wait, multi_tenant=True)
        return cls(dist.PrefixStore("ddphooks-spmd/", store), rank, world)

    def _key(self, name: str) -> str:
        n = self._calls.get(name, 0) + 1
        self._calls[name] = n
        return f"{name}/{n}"

    def post(self, name: str, value: bytes) -> str:
        """This rank's ``value`` for the n-th call of ``name``, not waiting for the others';
        returns the call's key."""
        key = self._key(name)
        self.store.set(f"{key}/{self.rank}", value)
        return key

    def all_gather(
        self, name: str, value: bytes, timeout: float, what: str = "arrive", watch: str | None = None
    ) -> list[bytes]:
        """Every rank's ``value`` for the n-th call of ``name``; RanksMissing after ``timeout``.
        With ``watch``, a rank that posts ``watch/<rank>`` meanwhile raises RankHung."""
        key = self.post(name, value)
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        self._await(keys, timeout, what, watch)
        return [bytes(self.store.get(k)) for k in keys]

    def _await(self, keys: list[str], timeout: float, what: str, watch: str | None) -> None:
        """Until every key is there. Asked in steps (``check`` logs nothing, where a ``wait``
        that times out logs a warning into the test's stderr), the first ones short."""
        deadline = time.monotonic() + timeout
        step = 0.001
        while not self.store.check(keys):
            if watch is not None:
                for r in range(self.world_size):
                    # this rank's own post: its watchdog reports it (the body returned late)
                    if r != self.rank and self.store.check([f"{watch}/{r}"]):
                        raise RankHung(r, HangPost.loads(bytes(self.store.get(f"{watch}/{r}"))).text)
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                if missing:
                    raise RanksMissing(what, missing, timeout)
                return
            time.sleep(step)
            step = min(step * 2, 0.05)

    def hand_over(self, name: str, blob: bytes) -> None:
        """This rank's ``blob`` (of any size) under ``name``, once a session, outside the
        ranks' lockstep calls: what a rank leaves for rank 0 as a hang ends the run."""
        key = f"{name}-handed-over/{self.rank}"
        chunks = blobs.put(self.store, key, blob)
        self.store.set(f"{key}/n", str(chunks).encode())  # last: the blob is whole once this is there

    def handed_over(self, name: str, ranks: Iterable[int], timeout: float) -> dict[int, bytes]:
        """What those of ``ranks`` handed over under ``name``, waiting ``timeout`` seconds at
        most for the ones that did not yet (a rank stuck in native code never does)."""
        deadline = time.monotonic() + timeout
        pending, taken = set(ranks), {}
        while True:
            for r in sorted(pending):
                key = f"{name}-handed-over/{r}"
                if self.store.check([f"{key}/n"]):
                    taken[r] = blobs.get(self.store, key, int(bytes(self.store.get(f"{key}/n"))))
            pending -= taken.keys()
            if not pending or time.monotonic() >= deadline:
                return taken
            time.sleep(0.05)

    def arrived(self, name: str) -> dict[int, bytes]:
        """What the ranks that already posted for this rank's next call of ``name`` posted."""
        n = self._calls.get(name, 0) + 1
        keys = {r: f"{name}/{n}/{r}" for r in range(self.world_size)}
        return {r: bytes(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}


def first_difference(lists: Sequence[Sequence[str]]) -> str | None:
    """The first place where a rank's collected tests differ from rank 0's, in words."""
    ref = list(lists[0])
    for rank, other in enumerate(lists[1:], start=1):
        other = list(other)
        if other == ref:
            continue
        for i, (a, b) in enumerate(zip(ref, other, strict=False)):
            if a != b:
                return f"test #{i + 1}: rank 0 collected {a!r}, rank {rank} collected {b!r}"
        if len(other) < len(ref):
            missing = ref[len(other)]
            return f"rank 0 collected {len(ref)} tests, rank {rank} only {len(other)}; the first missing: {missing!r}"
        return f"rank {rank} collected {len(other)} tests, rank 0 only {len(ref)}; the first extra: {other[len(ref)]!r}"
    return None


def init_group(store: Any, rank: int, world_size: int, generation: int, timeout: float) -> None:
    """(Re-)create the session's default process group on a fresh part of the store."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "gloo"
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"pg{generation}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def say(text: str) -> None:
    """A line to the real stderr of this rank, whatever pytest captures."""
    try:
        os.write(_REAL_STDERR, (text.rstrip("\n") + "\n").encode())
    except OSError:
        sys.stderr.write(text + "\n")
