"""Recording of torch.distributed calls into the current Recorder.

The functions of ``torch.distributed.distributed_c10d`` are wrapped the moment that module
has run, before ``torch.distributed`` star-imports them, so every later ``dist.barrier``,
``from torch.distributed import all_reduce`` and torch-internal call sees the wrapper.
Calls made from inside a recorded call (``broadcast_object_list`` broadcasting its sizes)
are not recorded again. With no recorder active the wrapper only forwards.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

from . import collectives, core, events
from .collectives import OPS, PAYLOAD_ARG, describe_tensor

_C10D = "torch.distributed.distributed_c10d"
_MARK = "__ddphooks_original__"
_tls = threading.local()
_OBJECT_OPS = {"all_gather_object", "gather_object", "scatter_object_list"}
_REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
_ranks_cache: dict[str, list[int]] = {}


def install() -> None:
    """Record torch.distributed calls from now on: patch now if loaded, else as it loads."""
    module = sys.modules.get(_C10D)
    if module is not None:
        _patch(module)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def installed() -> bool:
    module = sys.modules.get(_C10D)
    return module is not None and hasattr(getattr(module, "barrier", None), _MARK)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _C10D:
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
        _patch(module)
        for finder in list(sys.meta_path):
            if isinstance(finder, _PatchOnImport):
                sys.meta_path.remove(finder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _patch(c10d: types.ModuleType) -> None:
    public = sys.modules.get("torch.distributed")
    for op in OPS:
        original = getattr(c10d, op, None)
        if original is None or hasattr(original, _MARK):
            continue
        wrapper = _wrap(op, original)
        setattr(c10d, op, wrapper)
        if public is not None and getattr(public, op, None) is original:
            setattr(public, op, wrapper)


def _dist() -> Any:
    return sys.modules["torch.distributed"]


def _group_key(group: Any) -> str:
    dist = _dist()
    if group is None or group is dist.GroupMember.WORLD:
        return "default"
    name = getattr(group, "group_name", None)
    return str(name) if name else f"pg{id(group):x}"


def _group_ranks(group: Any, key: str) -> list[int]:
    ranks = _ranks_cache.get(key)
    if ranks is None:
        ranks = _ranks_cache[key] = list(_dist().get_process_group_ranks(group))
    return ranks


def _global(group: Any, root: Any, group_root: Any) -> int | None:
    if root is not None:
        return int(root)
    if group_root is not None and group is not None:
        return int(_dist().get_global_rank(group, group_root))
    return None if group_root is None else int(group_root)


def _reduce_op_name(reduce_op: Any) -> str:
    """``SUM`` for ``ReduceOp.SUM``, for ``ReduceOp(ReduceOp.SUM)``, and when omitted."""
    if reduce_op is None:
        return "SUM"
    reduce_op = getattr(reduce_op, "op", reduce_op)  # a ReduceOp object wraps a RedOpType
    name = getattr(reduce_op, "name", None)
    return str(name) if name is not None else str(reduce_op)


def _wrap(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    kind, sync, root_arg, group_root_arg = OPS[op]
    signature = inspect.signature(original)
    params = tuple(signature.parameters)
    # what an omitted argument means (older torch has e.g. ``src=0`` in the signature)
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
    payload_arg = PAYLOAD_ARG.get(op)
    name = "dist." + op

    def describe(rec: core.Recorder, bound: dict[str, Any]) -> dict[str, Any]:
        dist = _dist()
        existed = bool(dist.is_initialized())
        info: dict[str, Any] = {"op": op, "group_existed": existed}
        if kind == events.GROUP:
            if op == "init_process_group":
                backend = bound.get("backend")
                info["backend"] = None if backend is None else str(backend)
            elif op == "new_group":
                ranks = bound.get("ranks")
                info["ranks"] = None if ranks is None else [int(r) for r in ranks]
            else:
                info["group"] = _group_key(bound.get("group"))
            return info
        group = bound.get("group")
        if not existed or group is dist.GroupMember.NON_GROUP_MEMBER:
            info["effective"] = False
            if existed:
                info["member"] = False
            return info
        key = _group_key(group)
        info["group"] = key
        if key == "default":
            info["group_size"] = int(dist.get_world_size())
        else:
            info["ranks"] = _group_ranks(group, key)
        if bound.get("async_op") or op in ("isend", "irecv"):
            info["async"] = True
        if kind == events.P2P:
            me = int(dist.get_rank())
            peer = _global(group, bound.get(root_arg or ""), bound.get(group_root_arg or ""))
            tag = int(bound.get("tag") or 0)
            info["sync"], info["tag"] = sync, tag
            info["payload"] = describe_tensor(bound.get("tensor"))
            if sync == collectives.SEND:
                info.update(src=me, dst=peer, seq=rec.next_p2p((key, me, peer, tag)))
            else:
                info.update(src=peer, dst=me)
            return info
        info["seq"] = rec.next_seq(key)
        if op in _OBJECT_OPS:
            info["payload"] = "object"
        elif op == "broadcast_object_list":
            # the root's list holds the objects, the others' placeholders: only the length is shared
            objects = bound.get("object_list")
            info["payload"] = f"objects x{len(objects)}" if isinstance(objects, (list, tuple)) else "objects"
        elif payload_arg is not None:
            info["payload"] = describe_tensor(bound.get(payload_arg))
        if root_arg is not None:
            root, group_root = bound.get(root_arg), bound.get(group_root_arg or "")
            if root is None and group_root is None and op in collectives.DEFAULT_ROOT_ZERO:
                root = 0  # what torch does then
            info["root"] = _global(group, root, group_root)
        if op in _REDUCING:
            info["reduce_op"] = _reduce_op_name(bound.get("op"))
        return info

    def describe_safely(rec: core.Recorder, bound: dict[str, Any]) -> dict[str, Any]:
        # the recorder must never be why a call fails: a call it cannot describe is recorded bare
        try:
            return describe(rec, bound)
        except Exception as exc:
            return {"op": op, "recorder_error": core._error_text(exc)}

    def after_safely(rec: core.Recorder, info: dict[str, Any], result: Any) -> dict[str, Any] | None:
        try:
            return after(rec, info, result)
        except Exception as exc:
            return {"recorder_error": core._error_text(exc)}

    def after(rec: core.Recorder, info: dict[str, Any], result: Any) -> dict[str, Any] | None:
        out: dict[str, Any] = {"async": True} if info.get("async") else {}
        if op == "init_process_group":
            dist = _dist()
            out.update(rank=int(dist.get_rank()), world_size=int(dist.get_world_size()))
        elif op == "new_group":
            dist = _dist()
            out["group"] = "non-member" if result is dist.GroupMember.NON_GROUP_MEMBER else _group_key(result)
        elif op in ("destroy_process_group",):
            _ranks_cache.clear()
        elif kind == events.P2P and info.get("sync") == collectives.RECV and "group" in info:
            src = result if op == "recv" and isinstance(result, int) else info.get("src")
            if src is not None:
                src = int(src)
                out.update(src=src, seq=rec.next_p2p((info["group"], src, info["dst"], info["tag"])))
        return out or None

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        rec = core._current
        if rec is None or getattr(_tls, "depth", 0):
            return original(*args, **kwargs)
        bound = dict(defaults)
        bound.update(zip(params, args, strict=False))
        if kwargs:
            bound.update(kwargs)
        info = describe_safely(rec, bound)
        call_id = rec.begin(kind, name, info)
        _tls.depth = 1
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            _tls.depth = 0
            failed: dict[str, Any] = {"error": core._error_text(exc)}
            if info.get("async"):
                failed["async"] = True
            rec.end(call_id, kind, name, failed)
            raise
        _tls.depth = 0
        rec.end(call_id, kind, name, after_safely(rec, info, result))
        return result

    setattr(wrapper, _MARK, original)
    return wrapper
