"""Recording of torch.distributed into the current Recorder, whichever API issues a call.

What is recorded:
- the functions of ``torch.distributed.distributed_c10d`` (``dist.barrier``, the private
  ``all_gather_single`` / ``reduce_scatter_single`` FSDP2 calls, ...), wrapped the moment
  that module has run, before ``torch.distributed`` star-imports them, so every later
  ``dist.barrier``, ``from torch.distributed import all_reduce`` and torch-internal call sees
  the wrapper;
- the methods of ``ProcessGroup`` (``pg.allreduce([t])``, ``dist.group.WORLD.barrier()``,
  Lightning's ``group.monitored_barrier()``);
- the functional collectives (``torch.distributed._functional_collectives``, which DTensor
  uses) and ``wait_tensor``;
- ``Work.wait()``: where an asynchronous call completes.

Every call reads its group's own sequence counter before and after it runs. Collectives are
paired across ranks by that counter (``Recorder.collective_seq``): a collective the recorder
cannot see (DDP's reducer issues its all-reduces from C++) leaves a gap in the numbers, never
a shift, so no two different collectives are ever taken for one. A call made from inside a
recorded call (``broadcast_object_list`` broadcasting its sizes, ``dist.all_reduce`` calling
``pg.allreduce``) is not recorded again. With no recorder active the wrappers only forward.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import re
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

from .. import torch_defaults
from . import active, collectives, events, warnsite
from .collectives import OPS, PAYLOAD_ARG, describe_tensor
from .log import EventLog, Pending, error_text
from .log import group_counter as _counter

_C10D = "torch.distributed.distributed_c10d"
_FUNCOL = "torch.distributed._functional_collectives"
_FUTURES = "torch.futures"
_MARK = "__ddphooks_original__"

warnsite.skip_frames_of(__file__)  # a warning inside a wrapper names its caller


class _Depth(threading.local):
    depth = 0  # 1 while a recorded call runs on this thread: what it calls is not recorded again


_tls = _Depth()
_OBJECT_OPS = {"all_gather_object", "gather_object", "scatter_object_list"}
_REDUCING = {
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
}
# set as distributed_c10d is patched: its registry of groups, and its non-member marker
_c10d_world: Any = None
_NON_GROUP_MEMBER: Any = object()


def install() -> None:
    """Record torch.distributed calls from now on: patch now if loaded, else as it loads."""
    for name in _PATCHERS:
        module = sys.modules.get(name)
        # every rank activates a recorder: a module patched already is not walked again
        if module is not None and _patched.get(name) is not module:
            _patch(name, module)
    _know_compiling()
    if not all(name in sys.modules for name in _PATCHERS) and not any(
        isinstance(f, _PatchOnImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _PatchOnImport())


_patched: dict[str, types.ModuleType] = {}  # module name -> the module object last patched


def _patch(name: str, module: types.ModuleType) -> None:
    _PATCHERS[name](module)
    _patched[name] = module
    _know_compiling()


def _know_compiling() -> None:
    """Take torch.compiler.is_compiling once torch has it (it may still be importing)."""
    global _compiling
    found = getattr(getattr(sys.modules.get("torch"), "compiler", None), "is_compiling", None)
    if found is not None:
        _compiling = found


def installed() -> bool:
    module = sys.modules.get(_C10D)
    return module is not None and hasattr(getattr(module, "barrier", None), _MARK)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PATCHERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module.__name__, module)
        if all(name in sys.modules for name in _PATCHERS):
            for finder in list(sys.meta_path):
                if isinstance(finder, _PatchOnImport):
                    sys.meta_path.remove(finder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _dist() -> Any:
    return sys.modules["torch.distributed"]


def _not_compiling() -> bool:
    return False


# whether torch.compile is tracing the call (torch.compiler.is_compiling, once torch has it):
# then a wrapper is not there (the graph's collectives run from native code, read as such),
# and never what breaks the tracing
_compiling: Callable[[], bool] = _not_compiling


# -- what a call is about: its group, its place in the group's sequence --------------------


def _group_name(group: Any, world: Any = None) -> str:
    if world is None:
        world = _dist().GroupMember.WORLD
    if group is None or group is world:
        return "default"
    name = getattr(group, "group_name", None)
    return str(name) if name else f"pg{id(group):x}"


def _process_group(group: Any) -> Any:
    return _dist().distributed_c10d._get_default_group() if group is None else group


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of a rank of ``group`` (None: the default group)."""
    found = _global(group, None, group_rank)
    assert found is not None
    return found


def _global(group: Any, root: Any, group_root: Any) -> int | None:
    if root is not None:
        return int(root)
    if group_root is not None and group is not None and group is not _dist().GroupMember.WORLD:
        return int(_dist().get_global_rank(group, group_root))
    return None if group_root is None else int(group_root)


def _reduce_op_name(reduce_op: Any) -> str:
    """``SUM`` for ``ReduceOp.SUM``, for ``ReduceOp(ReduceOp.SUM)``, for ``"sum"``, and when omitted."""
    if reduce_op is None:
        return "SUM"
    if isinstance(reduce_op, str):
        return reduce_op.upper()
    reduce_op = getattr(reduce_op, "op", reduce_op)  # a ReduceOp object wraps a RedOpType
    name = getattr(reduce_op, "name", None)
    return str(name) if name is not None else str(reduce_op)


class Call:
    """One recorded collective or send/recv: its start event's info and its group; ``static``,
    when the info is that never-changing dict plus its ``seq`` (the event file writes it compact)."""

    __slots__ = ("channel", "counter", "info", "numbered", "p2p", "pg", "static")

    def __init__(self, info: dict[str, Any], pg: Any = None, counter: int | None = None, p2p: bool = False) -> None:
        self.info, self.pg, self.counter, self.p2p = info, pg, counter, p2p
        self.static: dict[str, Any] | None = None
        self.numbered: tuple[str, ...] = ()
        # a send's or receive's channel, and its token there (``EventLog.channel_opened``)
        self.channel: tuple[tuple[Any, ...], list[bool]] | None = None


def _on_group(rec: EventLog, op: str, group: Any, api: str | None, async_op: bool) -> tuple[Call, str | None]:
    """The part of a call's description every API shares; a bare call when it reaches no group."""
    world = _default_group()  # None before it exists
    if world is None or group is _NON_GROUP_MEMBER:
        return _bare(op, api, world), None
    pg = world if group is None else group
    key, info = _group_info(rec, pg, world, op, api, async_op)
    rec.opened(key, collective=False)  # before the counter is read: from here another thread's call sees this one
    return Call(info, pg, _counter(pg)), key


def _group_info(
    rec: EventLog, pg: Any, world: Any, op: str, api: str | None, async_op: bool
) -> tuple[str, dict[str, Any]]:
    """The group's key, and the start of a call's info on it."""
    _, key, field, value, hollow = _known_group(rec, pg, world)
    info: dict[str, Any] = {"op": op, "group_existed": True}
    if api is not None:
        info["api"] = api
    info["group"] = key
    info[field] = value
    if hollow is not None:
        info["hollow"] = hollow
    if async_op:
        info["async"] = True
    return key, info


def _bare(op: str, api: str | None, world: Any) -> Call:
    """A call that reaches no group: before the default group exists, or on a rank outside it."""
    info: dict[str, Any] = {"op": op, "group_existed": world is not None}
    if api is not None:
        info["api"] = api
    info["effective"] = False
    if world is not None:
        info["member"] = False
    return Call(info)


# backends whose collectives return without waiting for any other rank (FakeProcessGroup,
# for tracing a program of many ranks in one process)
HOLLOW_BACKENDS = frozenset({"fake"})


def _hollow(pg: Any) -> str | None:
    """The group's backend when it synchronises nothing."""
    try:
        backend = str(_dist().get_backend(pg))
    except Exception:
        return None
    return backend if backend in HOLLOW_BACKENDS else None


def _known_group(rec: EventLog, pg: Any, world: Any) -> tuple[Any, str, str, Any, str | None]:
    """(the group, its key, its size for the default group or its global ranks, its backend
    when that synchronises nothing): what a group is never changes while it lives, so it is
    worked out once."""
    known = rec.described_groups.get(id(pg))
    if known is None or known[0] is not pg:
        if pg is world:
            known = (pg, rec.group_key("default"), "group_size", int(world.size()), _hollow(pg))
        else:
            key = rec.key_for_group(_group_name(pg, world), pg)
            known = (pg, key, "ranks", list(_dist().get_process_group_ranks(pg)), _hollow(pg))
            rec.knows_group(key, known[3])
        rec.described_groups[id(pg)] = known
        rec.first_seen(known[1], pg)
    return known


def take_over_groups(rec: EventLog) -> None:
    """A recorder that begins while groups exist counts their calls from here (or from where the
    last recorder left them): a send or receive unseen from here on is a gap."""
    world = _default_group()
    if world is None:
        return
    try:
        groups = [world, *(pg for pg in _c10d_world.pg_map if pg is not world)]
    except Exception:
        groups = [world]
    for pg in groups:
        try:
            _, key, *_ = _known_group(rec, pg, world)
        except Exception:
            continue  # a group that cannot be described now is taken as its calls find it
        rec.took_over(key, _counter(pg))


def _default_group() -> Any:
    """``GroupMember.WORLD``, read without the two properties in front of it (None before
    torch.distributed is imported: a recorder may begin first)."""
    try:
        return _c10d_world._default_pg
    except AttributeError:
        dist = sys.modules.get("torch.distributed")
        return None if dist is None else dist.GroupMember.WORLD


def describe_collective(
    rec: EventLog,
    op: str,
    group: Any,
    *,
    api: str | None = None,
    async_op: bool = False,
    payload: str | None = None,
    root: int | None = None,
    reduce_op: Any = None,
) -> Call:
    world = _default_group()
    if world is None or group is _NON_GROUP_MEMBER:
        return _bare(op, api, world)
    pg = world if group is None else group
    # the same call again (a training loop's): only its place in the group's sequence is new
    cache = rec.described_calls
    shape = (op, id(pg), api, async_op, payload, root, reduce_op if op in _REDUCING else None)
    cacheable = True
    try:
        known = cache.get(shape)
    except TypeError:  # an argument that cannot be a key: described every time
        known, cacheable = None, False
    if known is None or known[0] is not pg:
        known = _static_info(rec, pg, world, op, api, async_op, payload, root, reduce_op)
        if cacheable:
            if len(cache) >= 4096:
                cache.clear()
            cache[shape] = known
    _, key, static = known
    # before the counter is read: from here another thread's call sees this one
    rec.opened(key, collective=op != "monitored_barrier")
    call = Call(static, pg, _counter(pg))
    if api is None and op in _COALESCED_OPS and pg in getattr(_c10d_world, "pg_coalesce_state", ()):
        # only queued: the coalesced call the manager issues at its exit is the collective
        queued = {k: v for k, v in static.items() if k != "async"}
        call.info = {**queued, "unsure": _QUEUED, "queued": True}
        return call
    unsure = None
    if op == "monitored_barrier":
        # made of sends and receives (rank 0 with every other): its own count pairs it
        call.p2p = True
        rec.p2p_began(key, call.counter)
        seq, unseen = rec.next_seq(("monitored", key)), 0
    else:
        seq, unseen, unsure = rec.collective_seq(key, call.counter)
    if unsure is not None:
        # no number: it pairs with nothing, so it orders nothing, and says why
        call.info = {**static, "unsure": unsure}
        return call
    call.info = {**static, "seq": seq}
    if unseen:
        call.info["unseen"] = unseen
    else:
        call.static, call.numbered = static, _SEQ
    return call


_SEQ = ("seq",)
# what torch's functions only queue inside a coalescing manager (``dist._coalescing_manager``)
_COALESCED_OPS = frozenset(
    {"all_reduce", "all_gather_into_tensor", "all_gather_single", "_all_gather_base"}
    | {"reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"}
)
_QUEUED = (
    "it was only queued by a coalescing manager (_coalescing_manager), which issues the queued calls as one"
    " coalesced collective at its exit"
)
_WAITED = ("seq", "of")


def _static_info(
    rec: EventLog,
    pg: Any,
    world: Any,
    op: str,
    api: str | None,
    async_op: bool,
    payload: str | None,
    root: int | None,
    reduce_op: Any,
) -> tuple[Any, str, dict[str, Any]]:
    """What every call like this one says at its start, but its seq."""
    key, info = _group_info(rec, pg, world, op, api, async_op)
    if payload is not None:
        info["payload"] = payload
        if collectives.CANONICAL.get(op, op) == "all_gather" and (op != "all_gather" or not _uneven_gather(pg)):
            info["even"] = True  # every member's input must be the same size (see collectives.UNEVEN)
    if root is not None:
        info["root"] = root
    if op in _REDUCING:
        info["reduce_op"] = _reduce_op_name(reduce_op)
    return pg, key, info


def _uneven_gather(pg: Any) -> bool:
    """Whether the group's backend takes a list all-gather of different sizes (NCCL does; gloo
    refuses it); when unknown, assumed to, so that no desync is ever claimed on a guess."""
    try:
        return "nccl" in str(_dist().get_backend(pg)).lower()
    except Exception:
        return True


def _point_to_point(
    rec: EventLog,
    op: str,
    group: Any,
    sync: str,
    peer: int | None,
    tag: int,
    tensor: Any,
    *,
    api: str | None = None,
    async_op: bool = False,
) -> Call:
    call, key = _on_group(rec, op, group, api, async_op)
    if key is None:
        return call
    call.p2p = True
    rec.p2p_began(key, call.counter)
    info = call.info
    me = int(_dist().get_rank())
    info["sync"], info["tag"] = sync, tag
    info["payload"] = describe_tensor(tensor)
    if sync == collectives.SEND:
        info.update(src=me, dst=peer, seq=rec.next_p2p((key, me, peer, tag)))
        channel: tuple[Any, ...] = (key, collectives.SEND, me, peer, tag)
    else:
        info.update(src=peer, dst=me)
        channel = (key, collectives.RECV, me, tag)  # from any source: one that names none overlaps them all
    call.channel = (channel, rec.channel_opened(channel))
    return call


_OVERLAPPED = (
    "another thread of the rank had a send or receive in flight on the same channel meanwhile: which"
    " message each got cannot be told, so it is paired with nothing"
)


def _channel_closed(rec: EventLog, call: Call) -> dict[str, Any]:
    """What a send's or receive's end says of its channel: unpaired, if it overlapped another."""
    if call.channel is not None and rec.channel_closed(*call.channel):
        return {"unsure": _OVERLAPPED}
    return {}


def _received(rec: EventLog, call: Call, src: Any) -> dict[str, Any]:
    """The pairing of a receive, known once it returned (who sent, for ``src=None``)."""
    info = call.info
    if info.get("sync") != collectives.RECV or "group" not in info or src is None:
        return {}
    src = int(src)
    return {"src": src, "seq": rec.next_p2p((info["group"], src, info["dst"], info["tag"]))}


def run_recorded(
    rec: EventLog,
    kind: str,
    name: str,
    call: Call,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    after: Callable[[EventLog, Call, Any], dict[str, Any] | None] | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` recorded: its start, then its end (or the error it raised),
    the group's counter read around it; an asynchronous call's work is kept to record its
    wait. ``after(rec, call, result)`` adds what the return tells to the end event."""
    __tracebackhide__ = True
    info = call.info
    group = info.get("group", "") if call.pg is not None else ""  # opened as it was described
    try:
        call_id = rec.begin(kind, name, info, call.static, call.numbered)
    except BaseException:  # a fault armed at this point raised: the call never ran
        rec.counted(group, None, None, call.p2p)
        _channel_closed(rec, call)
        raise
    # a send or a receive advances the group's counter by one; a monitored barrier by its parts
    ops = 1 if call.p2p and info.get("op") != "monitored_barrier" else None
    outer = _tls.depth  # 1 for a wait recorded inside another call (which goes on unrecorded)
    _tls.depth = 1
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        _tls.depth = outer
        failed: dict[str, Any] = {"error": error_text(exc), **_channel_closed(rec, call)}
        if info.get("async"):
            failed["async"] = True
        counter_after = _counter(call.pg) if call.pg is not None else None
        if counter_after is not None and counter_after == call.counter:
            # raised before it reached the group (a bad root, a wrong list): no collective of
            # the group's sequence, though it was numbered as the next one
            failed["issued"] = False
            if info.get("op") == "monitored_barrier" and "seq" in info:
                rec.unnumber(("monitored", group), int(info["seq"]))
        rec.counted(group, call.counter, counter_after, call.p2p, ops, failed=True)
        rec.end(call_id, kind, name, failed)
        raise
    _tls.depth = outer
    out: dict[str, Any] | None = None
    done = False  # an asynchronous call that completed before it returned
    raced = False
    try:
        pg = call.pg
        if "async" in info and pg is not None and result is not None:
            targets = _awaitables(result)
            if targets is None:
                done = True
            elif len(targets) == 1:
                rec.awaiting(targets[0], call_id, name, info, call.static)
            else:  # the outputs of one coalesced call: waiting for any completes it
                for target in targets:
                    rec.handed(target, [(target, call_id, name, info, call.static)])
        if pg is not None:
            # numbered as it began, alone; another thread's collective on the group began before
            # it returned: which of the two the group took first is not known (a send or receive
            # is judged by its channel)
            raced = rec.counted(group, call.counter, _counter(pg), call.p2p, ops) and not call.p2p and "seq" in info
        if after is not None:
            out = after(rec, call, result)
        if call.channel is not None:
            unsure = _channel_closed(rec, call)
            if unsure:
                out = {**(out or {}), **unsure}
    except Exception as exc:  # the recorder must never be why a call fails
        out = {**(out or {}), "recorder_error": error_text(exc)}
    if raced:
        out = {**(out or {}), events.RACED: True}
    if "async" in info and not done:  # it completes at its wait, not at this return
        out = _ASYNC_END if not out else {"async": True, **out}
    rec.end(call_id, kind, name, out or None, _ASYNC_END if out is _ASYNC_END else None)
    return result


_ASYNC_END: dict[str, Any] = {"async": True}  # the end of every asynchronous call that went well


def _awaitables(result: Any) -> list[Any] | None:
    """What an asynchronous call's completion is waited on: its Work, the tensor a functional
    collective returned (each of a coalesced one's); None where a functional collective waited
    before it returned (an all-gather along another dimension than 0 returns the joined result)."""
    if isinstance(result, (list, tuple)):
        elems = [getattr(part, "elem", None) for part in result]
        if elems and all(elem is not None for elem in elems):
            return elems
        return None if all(hasattr(part, "dtype") for part in result) else [result]
    elem = getattr(result, "elem", None)
    if elem is not None:
        return [elem]
    return None if hasattr(result, "dtype") else [result]


def _awaitable(result: Any) -> Any:
    """What the completion of an asynchronous call is waited on: its Work, or the tensor a
    functional collective returned (an AsyncCollectiveTensor wraps it)."""
    return getattr(result, "elem", result)


def describe_safely(op: str, describe: Callable[..., Call], *args: Any) -> Call:
    """``describe(*args)``; a call the recorder cannot describe is recorded bare, never failed."""
    try:
        return describe(*args)
    except Exception as exc:
        return Call({"op": op, "recorder_error": error_text(exc)})


# -- the functions of distributed_c10d -------------------------------------------------------


def _patch_functions(c10d: types.ModuleType) -> None:
    global _c10d_world, _NON_GROUP_MEMBER
    _c10d_world = getattr(c10d, "_world", None)
    _NON_GROUP_MEMBER = c10d.GroupMember.NON_GROUP_MEMBER
    public = sys.modules.get("torch.distributed")
    for op in OPS:
        original = getattr(c10d, op, None)
        if original is None or hasattr(original, _MARK):
            continue
        wrapper = _wrap_function(op, original)
        setattr(c10d, op, wrapper)
        if public is not None and getattr(public, op, None) is original:
            setattr(public, op, wrapper)
    _patch_methods(sys.modules["torch._C._distributed_c10d"])


def _describe_group_op(rec: EventLog, op: str, bound: dict[str, Any]) -> Call:
    """init_process_group, new_group, destroy_process_group: no synchronisation claimed."""
    info: dict[str, Any] = {"op": op, "group_existed": bool(_dist().is_initialized())}
    if op == "init_process_group":
        backend = bound.get("backend")
        info["backend"] = None if backend is None else str(backend)
    elif op == "new_group":
        ranks = bound.get("ranks")
        info["ranks"] = None if ranks is None else [int(r) for r in ranks]
        if bound.get("use_local_synchronization"):
            info["local_sync"] = True  # only its members wait for each other
    else:
        group = bound.get("group")
        name = _group_name(group)
        info["group"] = rec.key_for_group(name, group) if group is not None else rec.group_key(name)
    return Call(info)


def _function_payload(op: str, bound: dict[str, Any]) -> str | None:
    if op in _OBJECT_OPS:
        return "object"
    if op == "broadcast_object_list":
        # the root's list holds the objects, the others' placeholders: only the length is shared
        objects = bound.get("object_list")
        return f"objects x{len(objects)}" if isinstance(objects, (list, tuple)) else "objects"
    payload_arg = PAYLOAD_ARG.get(op)
    return describe_tensor(bound.get(payload_arg)) if payload_arg is not None else None


def _describe_function_call(rec: EventLog, op: str, bound: dict[str, Any]) -> Call:
    """A call of a distributed_c10d function, from its bound arguments."""
    kind, sync, root_arg, group_root_arg = OPS[op]
    if kind == events.GROUP:
        return _describe_group_op(rec, op, bound)
    group = bound.get("group")
    async_op = bool(bound.get("async_op")) or op in ("isend", "irecv")
    if kind == events.P2P:
        peer = _global(group, bound.get(root_arg or ""), bound.get(group_root_arg or ""))
        tag = int(bound.get("tag") or 0)
        return _point_to_point(rec, op, group, sync, peer, tag, bound.get("tensor"), async_op=async_op)
    root = None
    if root_arg is not None:
        given, group_given = bound.get(root_arg), bound.get(group_root_arg or "")
        if given is None and group_given is None and op in collectives.DEFAULT_ROOT_ZERO:
            given = 0  # what torch does then
        root = _global(group, given, group_given)
    payload = _function_payload(op, bound)
    return describe_collective(rec, op, group, async_op=async_op, payload=payload, root=root, reduce_op=bound.get("op"))


def _after_function_call(op: str, rec: EventLog, call: Call, result: Any) -> dict[str, Any] | None:
    """What a function's return tells: the group it created, who sent what was received."""
    dist = _dist()
    if op == "init_process_group":
        default = _process_group(None)
        rec.group_created(rec.group_key("default"), default, _counter(default))
        rank, world_size = int(dist.get_rank()), int(dist.get_world_size())
        rec.joined(rank, world_size)
        return {"rank": rank, "world_size": world_size}
    if op == "new_group":
        if result is dist.GroupMember.NON_GROUP_MEMBER:
            return {"group": "non-member"}
        key = rec.key_for_group(_group_name(result), result)
        rec.group_created(key, result, _counter(result))
        return {"group": key}
    if op == "destroy_process_group":
        if not dist.is_initialized():  # every group went with the default one
            rec.groups_destroyed()
        return None
    if OPS[op][0] == events.P2P:
        src = result if op == "recv" and isinstance(result, int) else call.info.get("src")
        return _received(rec, call, src)
    return None


def _wrap_function(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    params = tuple(signature.parameters)
    # what an omitted argument means (older torch has e.g. ``src=0`` in the signature)
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
    kind = OPS[op][0]
    name = "dist." + op
    # a collective's return tells nothing more (its Work is kept by run_recorded)
    after = None if kind == events.COLLECTIVE else functools.partial(_after_function_call, op)

    def build(rec: EventLog, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        bound = dict(defaults)
        bound.update(zip(params, args, strict=False))
        if kwargs:
            bound.update(kwargs)
        return _describe_function_call(rec, op, bound)

    return _recording(op, kind, name, build, original, after)


# -- the methods of ProcessGroup, and Work.wait ----------------------------------------------


def one_tensor(value: Any) -> Any:
    """A method's list of one tensor is that tensor, as the functions take it."""
    if isinstance(value, (list, tuple)) and len(value) == 1 and getattr(value[0], "shape", None) is not None:
        return value[0]
    return value


def _tensors(value: Any) -> str:
    return describe_tensor(one_tensor(value))


def _option(value: Any, name: str) -> Any:
    return getattr(value, name, None) if value is not None and not isinstance(value, (int, float, str)) else None


def _root(pg: Any, args: tuple[Any, ...], at: int) -> int | None:
    """The group-relative root of a method (an int, or an options object's rootRank), as a global rank."""
    value = args[at] if len(args) > at else None
    relative = value if isinstance(value, int) else _option(value, "rootRank")
    return None if relative is None else _global(pg, None, int(relative))


# method -> (the op it is, how to describe its arguments: (pg, args) -> (payload, root, reduce op))
_Describe = Callable[[Any, tuple[Any, ...]], tuple[str | None, int | None, Any]]


def _reduce_of(args: tuple[Any, ...]) -> Any:
    """A method's reduce op: an options object's reduceOp, or a ReduceOp argument."""
    for value in args[1:]:
        if type(value).__name__ in ("ReduceOp", "RedOpType"):
            return value
        found = _option(value, "reduceOp")
        if found is not None:
            return found
    return None


def _first(pg: Any, a: tuple[Any, ...]) -> tuple[str | None, int | None, Any]:
    return (_tensors(a[0]) if a else None), None, _reduce_of(a)


def _second(pg: Any, a: tuple[Any, ...]) -> tuple[str | None, int | None, Any]:
    return (_tensors(a[1]) if len(a) > 1 else None), None, None


def _nothing(pg: Any, a: tuple[Any, ...]) -> tuple[str | None, int | None, Any]:
    return None, None, None


def _rooted_first(pg: Any, a: tuple[Any, ...]) -> tuple[str | None, int | None, Any]:
    return (_tensors(a[0]) if a else None), _root(pg, a, 1), _reduce_of(a)


def _rooted_second(pg: Any, a: tuple[Any, ...]) -> tuple[str | None, int | None, Any]:
    return (_tensors(a[1]) if len(a) > 1 else None), _root(pg, a, 2), None


def _scatter(pg: Any, a: tuple[Any, ...]) -> tuple[str | None, int | None, Any]:
    return (_tensors(a[0]) if a else None), _root(pg, a, 2), None


METHODS: dict[str, tuple[str, _Describe]] = {
    "allreduce": ("all_reduce", _first),
    "allreduce_coalesced": ("all_reduce_coalesced", _first),
    "allgather": ("all_gather", _second),
    "allgather_coalesced": ("all_gather_coalesced", _second),
    "_allgather_base": ("all_gather_into_tensor", _second),
    "all_gather_single": ("all_gather_into_tensor", _second),
    "allgather_into_tensor_coalesced": ("all_gather_coalesced", _second),
    "all_gather_single_coalesced": ("all_gather_coalesced", _second),  # a coalescing manager's
    "reduce_scatter": ("reduce_scatter", _first),
    "_reduce_scatter_base": ("reduce_scatter_tensor", _first),
    "reduce_scatter_single": ("reduce_scatter_tensor", _first),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", _first),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor", _first),  # a coalescing manager's
    "alltoall": ("all_to_all", _second),
    "alltoall_base": ("all_to_all_single", _second),
    "all_to_all_single": ("all_to_all_single", _second),
    "barrier": ("barrier", _nothing),
    "monitored_barrier": ("monitored_barrier", _nothing),
    "broadcast": ("broadcast", _rooted_first),
    "reduce": ("reduce", _rooted_first),
    "gather": ("gather", _rooted_second),
    "scatter": ("scatter", _scatter),
}
_P2P_METHODS = {
    "send": ("send", collectives.SEND),
    "recv": ("recv", collectives.RECV),
    "recv_anysource": ("recv", collectives.RECV),  # its sender is known only once it completed
}


def _itself(pg: Any, tensors: Any) -> Any:
    return pg


def _group_of_backend(backend: Any, tensors: Any) -> Any:
    """The process group whose backend (for the tensor's device) ``backend`` is; None if none."""
    device = one_tensor(tensors).device
    for pg in list(getattr(_c10d_world, "pg_map", {}) or {}):
        try:
            if pg._get_backend(device) is backend:
                return pg
        except Exception:
            continue
    return None


def _patch_methods(c10d_c: types.ModuleType) -> None:
    pg_type = getattr(c10d_c, "ProcessGroup", None)
    if pg_type is None:
        return
    for method, (op, describe) in METHODS.items():
        original = getattr(pg_type, method, None)
        if original is not None and not hasattr(original, _MARK):
            setattr(pg_type, method, _wrap_method(method, op, describe, original))
    # a backend's own sends and receives advance its group's counter like the group's: were
    # they not recorded, the rank's numbering of the group's collectives would shift
    for owner, group_of in ((pg_type, _itself), (getattr(c10d_c, "Backend", None), _group_of_backend)):
        if owner is None:
            continue
        for method, (op, sync) in _P2P_METHODS.items():
            original = getattr(owner, method, None)
            if original is not None and not hasattr(original, _MARK):
                setattr(owner, method, _wrap_p2p_method(owner.__name__, method, op, sync, original, group_of))
    work = getattr(c10d_c, "Work", None)
    if work is None:
        return
    original = getattr(work, "wait", None)
    if original is not None and not hasattr(original, _MARK):
        work.wait = _wrap_wait(original, _awaitable)
    original = getattr(work, "get_future", None)
    if original is not None and not hasattr(original, _MARK):
        work.get_future = _wrap_wait(original, _awaitable, future=True)
    original = getattr(work, "is_completed", None)
    if original is not None and not hasattr(original, _MARK):
        work.is_completed = _wrap_poll(original, _awaitable)
    reducer = getattr(c10d_c, "Reducer", None)
    original = getattr(reducer, "_set_forward_pass_work_handle", None)
    if original is not None and not hasattr(original, _MARK):
        reducer._set_forward_pass_work_handle = _wrap_handoff(original)  # type: ignore[union-attr]
    # a future a call was handed to, waited for (or found done) from Python: the call completes
    future = getattr(sys.modules.get("torch._C"), "Future", None)
    for method, wrap in (("wait", _wrap_wait), ("done", _wrap_poll)):
        original = getattr(future, method, None)
        if original is not None and not hasattr(original, _MARK):
            setattr(future, method, wrap(original, _identity))
    original = getattr(future, "then", None)
    if original is not None and not hasattr(original, _MARK):
        future.then = _wrap_derived(original, _listed)  # type: ignore[union-attr]


_PARAMETER = re.compile(r"[,(]\s*(\w+):")


def overloads(fn: Any) -> list[tuple[str, ...]]:
    """The parameter names (``self`` left out) of each overload of a pybind11 method, read
    from the signatures its docstring starts its overloads with."""
    name = getattr(fn, "__name__", "")
    out = []
    for line in (getattr(fn, "__doc__", None) or "").splitlines():
        line = re.sub(r"^\d+\.\s*", "", line.strip())
        if line.startswith(name + "("):
            out.append(tuple(p for p in _PARAMETER.findall(line) if p != "self"))
    return out


def positional(args: tuple[Any, ...], kwargs: dict[str, Any], signatures: list[tuple[str, ...]]) -> tuple[Any, ...]:
    """``args`` with ``kwargs`` put in their places by the first overload that has them all
    after the positional ones (None where one is left out); an error when none has: a call
    whose payload or root is not understood is recorded as one the recorder could not describe,
    never read without them (an empty all-reduce passed by keyword would seem to synchronise)."""
    if not kwargs:
        return args
    for names in signatures:
        later = names[len(args) :]
        if set(kwargs) <= set(later):
            last = max(later.index(k) for k in kwargs)
            return (*args, *(kwargs.get(n) for n in later[: last + 1]))
    raise TypeError(f"keyword arguments {sorted(kwargs)} match no overload the recorder knows")


def _wrap_method(method: str, op: str, describe: _Describe, original: Callable[..., Any]) -> Callable[..., Any]:
    name = "dist." + op
    api = "ProcessGroup." + method
    blocking = op == "monitored_barrier"  # it returns when done; the others return a Work
    signatures = overloads(original)

    def build(rec: EventLog, pg: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        payload, root, reduce_op = describe(pg, positional(args, kwargs, signatures))
        return describe_collective(
            rec, op, pg, api=api, async_op=not blocking, payload=payload, root=root, reduce_op=reduce_op
        )

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = active._current
        if rec is None or _tls.depth or _compiling():
            return original(self, *args, **kwargs)
        call = describe_safely(op, build, rec, self, args, kwargs)
        return run_recorded(rec, events.COLLECTIVE, name, call, original, (self, *args), kwargs)

    functools.update_wrapper(wrapper, original, assigned=("__name__", "__qualname__", "__doc__"))
    setattr(wrapper, _MARK, original)
    return wrapper


def _after_p2p_method(rec: EventLog, call: Call, result: Any) -> dict[str, Any]:
    return _received(rec, call, call.info.get("src"))


def _wrap_p2p_method(
    owner: str, method: str, op: str, sync: str, original: Callable[..., Any], group_of: Callable[[Any, Any], Any]
) -> Callable[..., Any]:
    name = "dist." + op
    api = f"{owner}.{method}"
    anysource = method == "recv_anysource"

    def build(rec: EventLog, pg: Any, tensors: Any, peer: int | None, tag: int) -> Call:
        peer_global = None if peer is None else _global(pg, None, int(peer))
        return _point_to_point(rec, op, pg, sync, peer_global, int(tag), one_tensor(tensors), api=api, async_op=True)

    def wrapper(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = active._current
        if rec is None or _tls.depth or _compiling():
            return original(self, tensors, *args, **kwargs)
        try:
            pg = group_of(self, tensors)
        except Exception:  # arguments the call itself refuses: its own error, not the recorder's
            pg = None
        if pg is None:
            return original(self, tensors, *args, **kwargs)
        if anysource:  # (tensors, tag)
            peer, tag = None, (args[0] if args else kwargs.get("tag", 0))
        else:  # (tensors, peer, tag)
            peer = args[0] if args else kwargs.get("dstRank", kwargs.get("srcRank"))
            tag = args[1] if len(args) > 1 else kwargs.get("tag", 0)
        call = describe_safely(op, build, rec, pg, tensors, peer, tag)
        call.pg = pg
        return run_recorded(rec, events.P2P, name, call, original, (self, tensors, *args), kwargs, _after_p2p_method)

    functools.update_wrapper(wrapper, original, assigned=("__name__", "__qualname__", "__doc__"))
    setattr(wrapper, _MARK, original)
    return wrapper


def _wrap_wait(
    original: Callable[..., Any], key: Callable[[Any], Any], future: bool = False, suffix: str | None = None
) -> Callable[..., Any]:
    """Record the wait of an asynchronous call the recorder saw issued: its completion. With
    ``future``, where the call was handed to a future (``Work.get_future``) or to native code:
    it was not left unwaited; whoever waits for the future from Python completes it
    (``Future.wait``), native code does so out of sight."""
    suffix = suffix or (".get_future" if future else ".wait")

    def wait(awaited: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = active._current
        if rec is None or not rec.awaits_any() or _compiling():
            return original(awaited, *args, **kwargs)
        # also inside another recorded call: torch waits for a functional collective's result
        # where a call uses it first (``dist.broadcast(r)``), and only recorded calls are awaited
        target = key(awaited)
        calls = rec.awaited_by(target)
        if not calls and hasattr(target, "untyped_storage"):
            calls = rec.awaited_by_view(target)  # a view of a functional collective's result
        if not calls:
            return original(awaited, *args, **kwargs)
        issued = calls[0][3]
        learn = None
        if not future and issued.get("sync") == collectives.RECV and issued.get("src") is None:
            # a receive from any source: who sent is known once it completed
            learn = functools.partial(_source_learned, issued, awaited)
        result = run_recorded(
            rec,
            events.WAIT,
            calls[0][2] + suffix,
            _wait_call(rec, calls[0], future),
            original,
            (awaited, *args),
            kwargs,
            learn,
        )  # a wait that raised (``wait(timeout=...)`` timed out) completed nothing: still pending
        rec.completed(target, calls)
        for other in calls[1:]:  # the others completed with it (a future made of several)
            run_recorded(rec, events.WAIT, other[2] + suffix, _wait_call(rec, other, future), _identity, (result,), {})
        if future:
            rec.handed(result, calls)  # its wait from Python completes them
            rec.handed(awaited, calls)  # and so does the Work's own, later
        return result

    functools.update_wrapper(wait, original, assigned=("__name__", "__qualname__", "__doc__"))
    setattr(wait, _MARK, original)
    return wait


def _wrap_handoff(original: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's reducer given a Work that it waits for in C++ (Join's notification all-reduce,
    through ``Reducer._set_forward_pass_work_handle``): handed out of sight, as to a future, so
    never reported as unwaited; it orders nothing unless Python waits for it too."""
    hand = _wrap_wait(_identity, _identity, future=True, suffix=".to_reducer")

    def handoff(reducer: Any, work: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        hand(work)
        return original(reducer, work, *args, **kwargs)

    functools.update_wrapper(handoff, original, assigned=("__name__", "__qualname__", "__doc__"))
    setattr(handoff, _MARK, original)
    return handoff


def _patch_ddp(module: types.ModuleType) -> None:
    ddp = getattr(module, "DistributedDataParallel", None)
    original = getattr(ddp, "_check_global_requires_backward_grad_sync", None)
    if original is not None and not hasattr(original, _MARK):
        ddp._check_global_requires_backward_grad_sync = _wrap_left_running(original)  # type: ignore[union-attr]


def _wrap_left_running(original: Callable[..., Any]) -> Callable[..., Any]:
    """DDP under Join: a rank that has not joined issues an all-reduce that joined ranks match,
    and drops its Work without waiting (torch's design, not the test's bug). What it leaves
    running is recorded as such (``.left_running``): never reported as unwaited, ordering nothing."""
    leave = _wrap_wait(_identity, _identity, future=True, suffix=".left_running")

    def check(ddp: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = active._current
        before = {id(t) for t in rec.pending_targets()} if rec is not None else set()
        result = original(ddp, *args, **kwargs)
        if rec is not None and active._current is rec:
            for target in rec.pending_targets():
                if id(target) not in before:
                    leave(target)
        return result

    functools.update_wrapper(check, original)
    setattr(check, _MARK, original)
    return check


def _source_learned(issued: dict[str, Any], work: Any, rec: EventLog, call: Call, result: Any) -> dict[str, Any]:
    """The pairing of a receive from any source, learned at its wait: the sender's rank (a
    global one) and its message number on the channel, as a blocking receive's return gives."""
    source = getattr(work, "_source_rank", None)
    if source is None:
        return {}
    src = int(source())
    group = next((pg for pg, key, *_ in tuple(rec.described_groups.values()) if key == issued.get("group")), None)
    if group is not None and group is not _default_group():
        src = global_rank(group, src)
    return _received(rec, Call(issued), src)


def _wait_call(rec: EventLog, pending: Pending, future: bool) -> Call:
    """The recorded wait of an asynchronous call."""
    _, of, _, issued, static = pending
    if static is None:
        call = Call(_wait_info(issued, future))
        call.info["of"] = of
    else:  # a collective issued in its usual form: so is its wait
        call = Call(_static_wait_info(rec, static, future))
        call.static, call.numbered = call.info, _WAITED
        call.info = {**call.static, "seq": issued["seq"], "of": of}
    return call


def _wrap_derived(original: Callable[..., Any], sources: Callable[[Any], list[Any]]) -> Callable[..., Any]:
    """A function that makes a future of others (``Future.then``: of the future it is called
    on; ``torch.futures.collect_all``: of the futures it is given). It completes after them,
    so a wait for it completes what was handed to them."""

    def derived(first: Any, *args: Any, **kwargs: Any) -> Any:
        made = original(first, *args, **kwargs)
        rec = active._current
        if rec is not None and not _compiling():
            calls = [call for future in sources(first) for call in rec.handed_to(future)]
            if calls:
                rec.handed(made, calls)
        return made

    functools.update_wrapper(derived, original, assigned=("__name__", "__qualname__", "__doc__"))
    setattr(derived, _MARK, original)
    return derived


def _identity(value: Any) -> Any:
    return value


def _listed(value: Any) -> list[Any]:
    return [value]


def _patch_futures(futures: types.ModuleType) -> None:
    original = getattr(futures, "wait_all", None)
    if original is not None and not hasattr(original, _MARK):
        futures.wait_all = _wrap_wait_all(original)  # type: ignore[attr-defined]
    original = getattr(futures, "collect_all", None)
    if original is not None and not hasattr(original, _MARK):
        futures.collect_all = _wrap_derived(original, list)  # type: ignore[attr-defined]


def _wrap_wait_all(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.futures.wait_all``: it waits in C++ (on futures of its own); once it returned,
    every future it was given is complete, as if each had been waited for."""
    completed = _wrap_wait(lambda future: None, _identity)

    def wait_all(futures: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        values = original(futures, *args, **kwargs)
        for future in futures:
            completed(future)
        return values

    functools.update_wrapper(wait_all, original)
    setattr(wait_all, _MARK, original)
    return wait_all


def _ended_well(awaited: Any) -> bool:
    """A Work or future found done ended without an error. A Work is asked through its
    future: its own ``exception()`` is deprecated, and torch says so on the rank's stderr."""
    try:
        get_future = getattr(type(awaited), "get_future", None)
        if get_future is not None:  # a Work
            future = None
            with contextlib.suppress(Exception):  # a Work without a future
                future = getattr(get_future, _MARK, get_future)(awaited)
            if future is None or not future.done():
                return awaited.exception() is None
            awaited = future
        awaited.value()  # a future: raises its error
        return True
    except Exception:
        return False


def _wrap_poll(original: Callable[..., Any], key: Callable[[Any], Any]) -> Callable[..., Any]:
    """``Work.is_completed()`` / ``Future.done()``: a poll that finds the call complete is where
    it completes, as a wait that returned at once would be."""
    waited = _wrap_wait(lambda awaited, done: done, key)

    def poll(awaited: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        done = original(awaited, *args, **kwargs)
        # done with an error (a time-out) is no completion: the wait that raises it says so
        return waited(awaited, done) if done is True and _ended_well(awaited) else done

    functools.update_wrapper(poll, original, assigned=("__name__", "__qualname__", "__doc__"))
    setattr(poll, _MARK, original)
    return poll


def _wait_info(issued: dict[str, Any], future: bool) -> dict[str, Any]:
    """What the wait of a call says of it: which call on which group (or between whom)."""
    info: dict[str, Any] = {
        k: issued[k] for k in ("op", "group", "ranks", "seq", "sync", "src", "dst", "tag") if k in issued
    }
    if future:
        info["future"] = True
    return info


def _static_wait_info(rec: EventLog, static: dict[str, Any], future: bool) -> dict[str, Any]:
    """``_wait_info`` of a call whose info is ``static`` plus its seq, less the seq: kept."""
    cache = rec.described_calls
    known = cache.get(("wait", id(static), future))
    if known is None or known[0] is not static:
        info = _wait_info(static, future)
        known = cache[("wait", id(static), future)] = (static, info)
    return known[1]  # type: ignore[no-any-return]


# -- functional collectives (DTensor's) ------------------------------------------------------

# function -> the op it is; its group, reduce op and root are found by argument name
FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_autograd": "all_gather_into_tensor",
    "all_gather_tensor": "all_gather_into_tensor",
    "all_gather_tensor_autograd": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_autograd": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "all_to_all_single_autograd": "all_to_all_single",
    "broadcast": "broadcast",
}


def _patch_functional(funcol: types.ModuleType) -> None:
    for function, op in FUNCTIONAL.items():
        original = getattr(funcol, function, None)
        if original is not None and not hasattr(original, _MARK):
            setattr(funcol, function, _wrap_functional(function, op, original, funcol))
    for function, wrap in (
        ("isend_inplace", _wrap_functional_p2p),
        ("irecv_inplace", _wrap_functional_p2p),
        ("batch_p2p_ops_inplace", _wrap_functional_batch),
    ):
        original = getattr(funcol, function, None)
        if original is not None and not hasattr(original, _MARK):
            setattr(funcol, function, wrap(function, original, funcol))
    original = getattr(funcol, "wait_tensor", None)
    if original is not None and not hasattr(original, _MARK):
        # typeshed's ModuleType declares no attribute to assign
        funcol.wait_tensor = _wrap_wait(original, _identity)  # type: ignore[attr-defined]


def _wrap_functional(function: str, op: str, original: Callable[..., Any], funcol: Any) -> Callable[..., Any]:
    name = "dist." + op
    api = "functional." + function
    params = tuple(inspect.signature(original).parameters)

    def build(rec: EventLog, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        bound = _bind(params, args, kwargs)
        group = _functional_group(funcol, bound.get("group"), bound.get("tag", ""))
        pg = _default_group() if group is None else group
        root = bound.get("src")
        payload = bound.get("self", bound.get("inputs"))
        if op == "reduce_scatter_tensor" and hasattr(payload, "shape"):
            payload = _scattered(payload, int(bound.get("scatter_dim") or 0), int(pg.size()))
        return describe_collective(
            rec,
            op,
            group,
            api=api,
            async_op=True,
            payload=_tensors(payload),
            root=None if root is None else _global(group, None, int(root)),
            reduce_op=bound.get("reduceOp"),
        )

    return _recording(op, events.COLLECTIVE, name, build, original)


def _recording(
    op: str,
    kind: str,
    name: str,
    build: Callable[[EventLog, tuple[Any, ...], dict[str, Any]], Call],
    original: Callable[..., Any],
    after: Callable[[EventLog, Call, Any], dict[str, Any] | None] | None = None,
) -> Callable[..., Any]:
    """``original`` recorded as ``name``, described by ``build(rec, args, kwargs)``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = active._current
        if rec is None or _tls.depth or _compiling():
            return original(*args, **kwargs)
        call = describe_safely(op, build, rec, args, kwargs)
        return run_recorded(rec, kind, name, call, original, args, kwargs, after)

    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    return wrapper


def _bind(params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A Python function's arguments by parameter name (those left out are not there)."""
    bound = dict(zip(params, args, strict=False))
    bound.update(kwargs)
    return bound


def _functional_group(funcol: Any, group: Any, tag: str = "") -> Any:
    """The ProcessGroup a functional call names (None: the default group)."""
    resolve = sys.modules["torch._C._distributed_c10d"]._resolve_process_group
    pg = resolve(funcol._resolve_group_name(group, tag))
    return None if pg is _default_group() else pg


def _wrap_functional_p2p(function: str, original: Callable[..., Any], funcol: Any) -> Callable[..., Any]:
    """``isend_inplace`` / ``irecv_inplace``: a send or receive like ``dist.isend``'s, which
    completes where its result is first used (unseen, it would move the group's count on two
    ranks alone and shift the pairing of every later collective on it)."""
    op = "isend" if function.startswith("isend") else "irecv"
    sync = collectives.SEND if op == "isend" else collectives.RECV
    peer_arg = "dst" if op == "isend" else "src"
    params = tuple(inspect.signature(original).parameters)

    def build(rec: EventLog, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        bound = _bind(params, args, kwargs)
        named = bound.get("group")
        group = None if named is None else _functional_group(funcol, named)  # None: torch's WORLD
        group_peer = bound.get("group_" + peer_arg, -1)
        given = bound.get(peer_arg) if group_peer in (None, -1) else None
        peer = _global(group, given, None if group_peer in (None, -1) else group_peer)
        tag = int(bound.get("tag") or 0)
        api = "functional." + function
        return _point_to_point(rec, op, group, sync, peer, tag, bound.get("tensor"), api=api, async_op=True)

    return _recording(op, events.P2P, "dist." + op, build, original, _after_p2p_method)


def _wrap_functional_batch(function: str, original: Callable[..., Any], funcol: Any) -> Callable[..., Any]:
    """``batch_p2p_ops_inplace``: its sends and receives are not recorded (they order
    nothing), but counted as they move the group's count and each channel's: the pairing of
    every later collective and message stays where it is."""
    params = tuple(inspect.signature(original).parameters)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = active._current
        if _compiling() or rec is None or _tls.depth:
            return original(*args, **kwargs)
        try:
            bound = _bind(params, args, kwargs)
            world = _default_group()
            named = bound.get("group_name")
            group = None if named in (None, "") else _functional_group(funcol, named)  # torch's default
            pg = world if group is None else group
            _, key, *_ = _known_group(rec, pg, world)
            me = int(_dist().get_rank())
            ops = list(bound.get("op_list") or [])
            peers = [_global(group, None, int(p)) for p in bound.get("peer_list") or []]
            tags = [int(t) for t in bound.get("tag_list") or [0] * len(ops)]
        except Exception:
            return original(*args, **kwargs)  # not understood: the gap it leaves is said as such
        rec.opened(key, collective=False)
        before = _counter(pg)
        rec.p2p_began(key, before)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            rec.counted(key, before, _counter(pg), True, failed=True)
            raise
        rec.counted(key, before, _counter(pg), True, len(ops))
        for op, peer, tag in zip(ops, peers, tags, strict=False):
            rec.next_p2p((key, me, peer, tag) if "send" in op else (key, peer, me, tag))
        return result

    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    return wrapper


def _scattered(tensor: Any, dim: int, size: int) -> Any:
    """What a reduce-scatter of ``tensor`` gives each member (as the other APIs describe the
    call, by its output): a tensor without data, of that shape."""
    shape = list(tensor.shape)
    if size > 0 and shape:
        shape[dim] //= size
    return sys.modules["torch"].empty(shape, dtype=tensor.dtype, device="meta")


_PATCHERS: dict[str, Callable[[types.ModuleType], None]] = {
    _C10D: _patch_functions,
    _FUNCOL: _patch_functional,
    _FUTURES: _patch_futures,
    "torch.nn.parallel.distributed": _patch_ddp,
    # not patched: read as torch loads, before any other code could seed it (for ranks forked later)
    "torch.random": torch_defaults.note_import_state,
}
