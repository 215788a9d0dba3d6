"""What each torch.distributed call means for ordering, and how its arguments are described.

The sync field of ``OPS`` says which ranks a completed call orders after which:
- ``all``: every member waits for every other (barrier, all-reduce-like ops);
- ``from_root``: the root's past reaches the others (broadcast, scatter);
- ``to_root``: the others' past reaches the root (reduce, gather);
- ``send`` / ``recv``: one edge from the sender to the receiver;
- ``none``: no synchronisation is claimed (group creation and destruction).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import events

ALL = "all"
FROM_ROOT = "from_root"
TO_ROOT = "to_root"
SEND = "send"
RECV = "recv"
NONE = "none"

# op -> (event kind, sync, name of the root argument, name of its group-relative twin)
OPS: dict[str, tuple[str, str, str | None, str | None]] = {
    "init_process_group": (events.GROUP, NONE, None, None),
    "destroy_process_group": (events.GROUP, NONE, None, None),
    "new_group": (events.GROUP, NONE, None, None),
    "barrier": (events.COLLECTIVE, ALL, None, None),
    "monitored_barrier": (events.COLLECTIVE, ALL, None, None),
    "all_reduce": (events.COLLECTIVE, ALL, None, None),
    "all_gather": (events.COLLECTIVE, ALL, None, None),
    "all_gather_object": (events.COLLECTIVE, ALL, None, None),
    "all_gather_into_tensor": (events.COLLECTIVE, ALL, None, None),
    "all_gather_single": (events.COLLECTIVE, ALL, None, None),
    "_all_gather_base": (events.COLLECTIVE, ALL, None, None),
    "all_gather_coalesced": (events.COLLECTIVE, ALL, None, None),
    "all_reduce_coalesced": (events.COLLECTIVE, ALL, None, None),
    "reduce_scatter": (events.COLLECTIVE, ALL, None, None),
    "reduce_scatter_tensor": (events.COLLECTIVE, ALL, None, None),
    "reduce_scatter_single": (events.COLLECTIVE, ALL, None, None),
    "_reduce_scatter_base": (events.COLLECTIVE, ALL, None, None),
    "all_to_all": (events.COLLECTIVE, ALL, None, None),
    "all_to_all_single": (events.COLLECTIVE, ALL, None, None),
    "broadcast": (events.COLLECTIVE, FROM_ROOT, "src", "group_src"),
    "broadcast_object_list": (events.COLLECTIVE, FROM_ROOT, "src", "group_src"),
    "scatter": (events.COLLECTIVE, FROM_ROOT, "src", "group_src"),
    "scatter_object_list": (events.COLLECTIVE, FROM_ROOT, "src", "group_src"),
    "reduce": (events.COLLECTIVE, TO_ROOT, "dst", "group_dst"),
    "gather": (events.COLLECTIVE, TO_ROOT, "dst", "group_dst"),
    "gather_object": (events.COLLECTIVE, TO_ROOT, "dst", "group_dst"),
    "send": (events.P2P, SEND, "dst", "group_dst"),
    "isend": (events.P2P, SEND, "dst", "group_dst"),
    "recv": (events.P2P, RECV, "src", "group_src"),
    "irecv": (events.P2P, RECV, "src", "group_src"),
}

# The argument whose shape and dtype identify a collective's payload on every rank alike.
PAYLOAD_ARG: dict[str, str] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "_all_gather_base": "input_tensor",
    "all_gather_coalesced": "input_tensor_list",
    "all_reduce_coalesced": "tensors",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
    "reduce_scatter_single": "output",
    "_reduce_scatter_base": "output",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "scatter": "tensor",
    "gather": "tensor",
    "send": "tensor",
    "isend": "tensor",
    "recv": "tensor",
    "irecv": "tensor",
    "broadcast_object_list": "object_list",
}

_DTYPE_SHORT = {"torch.float32": "float32", "torch.float64": "float64", "torch.int64": "int64"}


_described: dict[tuple[Any, Any], str] = {}


# group calls that return only once every rank of the default group called them
JOINS = ("init_process_group", "new_group")


def describe_tensor(value: Any) -> str:
    """``float32[4,2]`` for a tensor, ``[float32[4] x2]`` for a list of them."""
    try:
        key = (value.dtype, value.shape)
        text = _described.get(key)
    except (AttributeError, TypeError):  # not a tensor, or one whose dtype or shape cannot be a key
        return _describe_other(value)
    if text is None:
        if len(_described) >= 4096:  # a model has a few dozen shapes; a bound for any other
            _described.clear()
        text = _described[key] = _describe_other(value)
    return text


def _describe_other(value: Any) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        d = str(dtype)
        d = _DTYPE_SHORT.get(d, d.removeprefix("torch."))
        return f"{d}[{','.join(str(s) for s in shape)}]"
    if isinstance(value, (list, tuple)):
        if value and all(getattr(v, "shape", None) is not None for v in value):
            inner = {describe_tensor(v) for v in value}
            if len(inner) == 1:
                return f"[{inner.pop()} x{len(value)}]"
            return "[" + ", ".join(describe_tensor(v) for v in value) + "]"
        return f"objects x{len(value)}"
    return "object"


def signature(op: str, info: Mapping[str, Any]) -> str:
    """The text a desync report prints for one call: ``broadcast(float32[4], src=0)``."""
    parts = []
    if "payload" in info:
        parts.append(str(info["payload"]))
    if info.get("root") is not None:
        _, _, root_arg, _ = OPS.get(op, (None, None, "root", None))
        parts.append(f"{root_arg}={info['root']}")
    if info.get("reduce_op") not in (None, "SUM"):
        parts.append(f"op={info['reduce_op']}")
    return f"{op}({', '.join(parts)})"


# Ops whose members may legally pass tensors of different shapes (uneven splits): only the
# dtypes of their payloads must agree. An all-gather is uneven only where its info does not
# say ``even`` (a list all-gather on NCCL; gloo and every all-gather into one tensor need the
# same size on every member).
UNEVEN: frozenset[str] = frozenset({"all_to_all", "all_to_all_single", "all_gather", "reduce_scatter"})

# The same collective reached through another API: a ProcessGroup method, an alias.
CANONICAL: dict[str, str] = {
    "_all_gather_base": "all_gather",
    "all_gather_single": "all_gather",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    # gloo runs a list all-gather and one into a tensor alike, a coalesced all-reduce of one
    # tensor as that tensor's all-reduce
    "all_gather_into_tensor": "all_gather",
    "all_reduce_coalesced": "all_reduce",
}

# Ops whose root, when neither the global nor the group-relative one is given, is global rank 0.
DEFAULT_ROOT_ZERO: frozenset[str] = frozenset(
    {"broadcast_object_list", "scatter", "scatter_object_list", "gather", "gather_object"}
)

_DTYPE_IN_PAYLOAD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[")
_TENSOR_IN_PAYLOAD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([0-9,]*)\]")
_REPEATED = re.compile(r"\[(.*) x(\d+)\]")


def payload_dtypes(payload: Any) -> tuple[str, ...] | Any:
    """The dtypes named in a payload text (``[float32[1], float32[3]]`` -> ``("float32",)``)."""
    if not isinstance(payload, str):
        return payload
    found = _DTYPE_IN_PAYLOAD.findall(payload)
    return tuple(sorted(set(found))) if found else payload


def payload_elements(payload: Any) -> tuple[tuple[str, int], ...] | Any:
    """What the backend compares of a payload: each tensor's dtype and element count, never
    its view (``float32[2,2]`` and ``float32[4]`` are the same; a list of one tensor is it)."""
    if not isinstance(payload, str):
        return payload
    repeated = _REPEATED.fullmatch(payload)
    body, times = (repeated.group(1), int(repeated.group(2))) if repeated else (payload, 1)
    found = _TENSOR_IN_PAYLOAD.findall(body)
    if not found:
        return payload
    items = []
    for dtype, dims in found:
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        items.append((dtype, n))
    return tuple(items * times)


# bytes per element of the dtypes a payload text names (torch's names, without "torch.")
_ITEM_BYTES = {
    **dict.fromkeys(("bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "quint8", "qint8"), 1),
    **dict.fromkeys(("int16", "uint16", "float16", "bfloat16"), 2),
    **dict.fromkeys(("int32", "uint32", "float32", "qint32"), 4),
    **dict.fromkeys(("int64", "uint64", "float64", "complex64"), 8),
    "complex128": 16,
}


def payload_bytes(payload: Any) -> int | None:
    """How many bytes a payload's tensors hold (None: not tensors, or a dtype of unknown size):
    what gloo compares of a send and the receive it meets."""
    elements = payload_elements(payload)
    if not isinstance(elements, tuple) or not elements:
        return None
    if any(dtype not in _ITEM_BYTES for dtype, _ in elements):
        return None
    return sum(_ITEM_BYTES[dtype] * n for dtype, n in elements)


def no_elements(payload: Any) -> bool:
    """The payload is tensors with no element at all (``float32[0]``, ``[int64[0,4] x2]``)."""
    elements = payload_elements(payload)
    return isinstance(elements, tuple) and bool(elements) and not any(n for _, n in elements)


def comparable(op: str, info: Mapping[str, Any], loose: bool = False) -> tuple[Any, ...]:
    """What must be equal on every member for two calls to be the same collective: what the
    backend itself checks (op, dtype, element count, root, reduce op), through any API. With
    ``loose`` (a member issued it from native code, whose root and reduce op are not known),
    the op and the payload only."""
    op = CANONICAL.get(op, op)
    payload = info.get("payload")
    payload = payload_dtypes(payload) if op in UNEVEN and not info.get("even") else payload_elements(payload)
    if loose:
        return (op, payload)
    return (op, payload, info.get("root"), info.get("reduce_op"))


def group_label(group: str, ranks: list[int] | None) -> str:
    base, again, _ = group.partition("+")
    if again:  # another group created under the name of one destroyed before it
        return group_label(base, ranks) + " (created again under its name)"
    name, _, incarnation = group.partition("/")
    if incarnation:
        return group_label(name, ranks) + f" (created again: incarnation {incarnation})"
    if group == "default":
        return "the default group"
    if ranks:
        return f"group {group} (ranks {','.join(str(r) for r in ranks)})"
    return f"group {group}"
