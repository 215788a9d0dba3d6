"""Collectives issued from native code, read from torch's flight recorder.

DDP's constructor (its parameter-shape check and broadcast) and reducer (its gradient buckets),
and compiled graphs, call ProcessGroup collectives from C++, where no Python wrapper sees them.
torch records every collective a ProcessGroupGloo enqueues in its flight recorder (on by
default since torch 2.6: the last 2000, ``TORCH_FR_BUFFER_SIZE``), with the group, the value of
the group's own counter right after it (``op_id``), the operation, the sizes and dtypes, the
time it was issued (on the clock of ``time.time_ns()``) and the issuing thread. Reading it costs
nothing while the rank runs; it is read when ``timeline()`` is called, when the rank finishes,
and when the watchdog asks a rank that made no progress.

An entry the recorder did not see itself (its place in the group's sequence has no recorded
call) becomes a pair of events at the time it was issued, with ``native`` in its info: native
code waits for it out of sight, so it orders nothing, but it takes its place in the sequence,
is compared with the other ranks' calls there, and shows in the timeline. Sends and receives
are not in the flight recorder; neither are collectives of other backends here.
"""

from __future__ import annotations

import pickle
import sys
import threading
from typing import Any

from . import events
from .events import RawEvent

# the flight recorder's operation names, as the recorder names the same operations
_OPS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor": "all_gather_into_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
}
_OUTPUT_PAYLOAD = {"reduce_scatter", "reduce_scatter_tensor", "scatter"}  # described by their output, as from Python
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


def _dump() -> list[dict[str, Any]]:
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return []
    try:
        return list(pickle.loads(dump(includeStackTraces=False)).get("entries", []))
    except Exception:
        return []  # no flight recorder in this build, or it is switched off


def _payload(op: str, entry: dict[str, Any]) -> str | None:
    which = "output" if op in _OUTPUT_PAYLOAD else "input"
    sizes, dtypes = entry.get(f"{which}_sizes") or [], entry.get(f"{which}_dtypes") or []
    if not sizes:
        return None
    parts = [
        f"{_DTYPES.get(str(d), str(d).lower())}[{','.join(str(n) for n in s)}]"
        for s, d in zip(sizes, dtypes, strict=False)
    ]
    if len(parts) == 1:
        return parts[0]
    return f"[{parts[0]} x{len(parts)}]" if len(set(parts)) == 1 else "[" + ", ".join(parts) + "]"


class NativeCalls:
    """Turns new flight-recorder entries of one rank into events of its log."""

    def __init__(self) -> None:
        self._last = -1  # the last record id read
        self._lock = threading.Lock()
        # after a read: None when the flight recorder still held every entry it had taken, else
        # per group the lowest op_id it held (what was older may have been let go)
        self.reliable_from: dict[str, int] | None = None
        self.held_any = False  # whether it held anything at all (it may be switched off)

    def read(self, log: Any) -> list[RawEvent]:
        """Events for the collectives native code issued since the last read, in time order
        (they go to the log's file and memory as they are returned)."""
        with self._lock:
            dumped = _dump()
            self.reliable_from, self.held_any = _held_from(log, dumped), bool(dumped)
            entries = [e for e in dumped if int(e.get("record_id", -1)) > self._last]
            if not entries:
                return []
            self._last = max(int(e["record_id"]) for e in entries)
            out: list[RawEvent] = []
            for entry in sorted(entries, key=lambda e: int(e.get("time_created_ns") or 0)):
                out.extend(self._events(log, entry))
            return out

    @staticmethod
    def _events(log: Any, entry: dict[str, Any]) -> list[RawEvent]:
        kind = str(entry.get("profiling_name", "")).partition(":")[2]
        found = _group_of(log, entry)
        if found is None or "send" in kind or "recv" in kind:
            return []  # a send or receive moves one rank's count alone: it explains no gap
        group, t_ns = found
        if entry.get("is_p2p"):
            return []
        op_id = int(entry.get("op_id", 0))
        if t_ns < log.born_ns:
            # issued before this log existed: no event of it; one since the log that handed the group
            # over left it (a fixture's barrier between two tests, under torchrun) explains a gap
            if t_ns >= log.explains_from(group):
                log.native_entry(group, op_id)
            return []
        log.native_entry(group, op_id)  # a collective, even one not named below: it took its number
        op = _OPS.get(kind)
        if op is None or not log.unseen(group, op_id):
            return []  # a call the recorder saw, or one nested in it (broadcast_object_list's)
        seq = log.seq_of(group, op_id)
        if seq is None:
            return []
        info: dict[str, Any] = {
            "op": op,
            "group_existed": True,
            "group": group,
            "seq": seq,
            "async": True,
            "native": str(entry.get("profiling_name")),  # the flight recorder's name of it
            "api": "native",
        }
        payload = _payload(op, entry)
        if payload is not None:
            info["payload"] = payload
        size = log.native_group_size(group)
        if group.partition("/")[0] == "default":
            info["group_size"] = size
        else:
            ranks = log.native_group_ranks(group)
            if ranks:
                info["ranks"] = ranks
        lane = log.lane_of_thread(int(entry.get("thread_id") or 0))
        call_id = log.next_call_id()
        name_ = "dist." + op
        return [
            (call_id, t_ns, lane, events.COLLECTIVE, events.START, name_, info),
            (call_id, t_ns, lane, events.COLLECTIVE, events.END, name_, {"async": True}),
        ]


def _group_of(log: Any, entry: dict[str, Any]) -> tuple[str, int] | None:
    """The key of an entry's group in ``log`` and the time it was issued; None for one of no
    group the log knows (no name: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``)."""
    name, desc = (*(entry.get("process_group") or ()), "", "")[:2]
    if not name:
        return None
    t_ns = int(entry.get("time_created_ns") or 0)
    group = log.native_group_key("default" if desc == "default_pg" else str(name), t_ns)
    return None if group is None else (group, t_ns)


def _held_from(log: Any, dumped: list[dict[str, Any]]) -> dict[str, int] | None:
    """None when the flight recorder let no entry go (its first record is still there), else
    per group the lowest op_id it still holds."""
    if not dumped or min(int(e.get("record_id", 0)) for e in dumped) == 0:
        return None
    out: dict[str, int] = {}
    for entry in dumped:
        found = _group_of(log, entry)
        if found is not None:
            op_id = int(entry.get("op_id", 0))
            out[found[0]] = min(out.get(found[0], op_id), op_id)
    return out
