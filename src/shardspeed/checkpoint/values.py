"""Python values in a checkpoint: JSON for the structure, tensors set aside for safetensors.

`encode` turns nested dicts, lists, tuples, numbers, strings, None and tensors into JSON, putting
each tensor into `tensors` under a generated key; anything else is refused with its path (a
checkpoint never holds code or pickles). `decode` reverses it. `all_gather_json`,
`broadcast_json` and `gather_json` share small JSON values between ranks as bytes, again without
pickle; `any_rank` tells every rank whether any rank raised a flag.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import ReduceOp, all_gather, all_reduce, broadcast, gather, get_rank, get_world_size
from .format import CheckpointError

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, path: str = "") -> Any:
    """`value` as JSON; tensors go into `tensors` as `<prefix><n>`."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = value.detach().cpu()
        return {_TENSOR: key}
    if isinstance(value, tuple | list):
        items = [encode(v, tensors, prefix, f"{path}[{i}]") for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {_TENSOR, _TUPLE, _ITEMS} & set(value):
            return {k: encode(v, tensors, prefix, f"{path}[{k!r}]") for k, v in value.items()}
        return {
            _ITEMS: [
                [
                    encode(k, tensors, prefix, f"{path} key"),
                    encode(v, tensors, prefix, f"{path}[{k!r}]"),
                ]
                for k, v in value.items()
            ]
        }
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy arrays and scalars
        return encode(torch.as_tensor(value), tensors, prefix, path)
    raise CheckpointError(
        f"{path or 'the value'} is a {type(value).__name__}: checkpoints hold JSON values "
        "(dict, list, tuple, number, string, None) and tensors only"
    )


def decode(value: Any, read_tensor: Callable[[str], torch.Tensor]) -> Any:
    """The value `encode` produced, with tensors read through `read_tensor`."""
    if isinstance(value, list):
        return [decode(v, read_tensor) for v in value]
    if isinstance(value, dict):
        if _TENSOR in value:
            return read_tensor(value[_TENSOR])
        if _TUPLE in value:
            return tuple(decode(v, read_tensor) for v in value[_TUPLE])
        if _ITEMS in value:
            return {decode(k, read_tensor): decode(v, read_tensor) for k, v in value[_ITEMS]}
        return {k: decode(v, read_tensor) for k, v in value.items()}
    return value


def _wire(group: Any) -> torch.device | None:
    """Where a collective's tensors must be: NCCL moves only device tensors; gloo only host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _as_bytes(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _json_of(data: torch.Tensor) -> Any:
    return json.loads(data.cpu().numpy().tobytes())


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able `value`, in rank order (sent as UTF-8 bytes, never pickled). Each
    rank receives every rank's value: for what one rank needs, `gather_json` and
    `broadcast_json` move what grows with the world through that rank only."""
    if get_world_size(group) == 1:
        return [value]
    device = _wire(group)
    data = _as_bytes(value)
    world = get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    lengths = [int(s) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    outputs = [torch.empty_like(padded) for _ in range(world)]
    all_gather(outputs, padded, group=group)
    return [_json_of(o[:n]) for o, n in zip(outputs, lengths)]


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether `flag` is true on any rank of `group` (one integer all-reduced)."""
    if get_world_size(group) == 1:
        return flag
    value = torch.tensor([int(flag)], device=_wire(group))
    all_reduce(value, op=ReduceOp.MAX, group=group)
    return bool(value.item())


def broadcast_json(value: Any, group: Any = None) -> Any:
    """The JSON-able `value` of the group's first rank, on every rank (two broadcasts: its length,
    its bytes). The others' `value` is what they start from: on torch's fake process group (a dry
    run, where nothing moves) each rank keeps its own."""
    if get_world_size(group) == 1:
        return value
    src = 0 if group is None else dist.get_global_rank(group, 0)
    device = _wire(group)
    data = _as_bytes(value)
    length = torch.tensor([data.numel()], device=device)
    broadcast(length, src, group=group)
    received = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    kept = min(received.numel(), data.numel())
    received[:kept] = data[:kept]
    broadcast(received, src, group=group)
    return _json_of(received)


def gather_json(value: Any, group: Any = None) -> list[Any] | None:
    """Every rank's JSON-able `value`, in rank order, on the group's first rank (None on the
    others), which alone receives what grows with the world."""
    if get_world_size(group) == 1:
        return [value]
    root = 0 if group is None else dist.get_global_rank(group, 0)
    here = get_rank() == root
    device = _wire(group)
    data = _as_bytes(value)
    # Every rank sends the longest value's length, padded: the lengths go to the root alone.
    longest = torch.tensor([data.numel()], device=device)
    all_reduce(longest, op=ReduceOp.MAX, group=group)
    world = get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    gather(torch.tensor([data.numel()], device=device), lengths if here else None, root, group)
    padded = torch.zeros(int(longest.item()), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    outputs = [torch.empty_like(padded) for _ in range(world)] if here else None
    gather(padded, outputs, root, group)
    if outputs is None:
        return None
    return [_json_of(o[: int(n.item())]) for o, n in zip(outputs, lengths)]
