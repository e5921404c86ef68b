"""Python values in a checkpoint: JSON for the structure, tensors set aside for safetensors.

`encode` turns nested dicts, lists, tuples, numbers, strings, None and tensors into JSON, putting
each tensor into `tensors` under a generated key; anything else is refused with its path (a
checkpoint never holds code or pickles). `decode` reverses it. `all_gather_json` shares small
JSON values between ranks as bytes, again without pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import all_gather, get_world_size
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


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able `value`, in rank order (sent as UTF-8 bytes, never pickled)."""
    if get_world_size(group) == 1:
        return [value]
    # NCCL moves only device tensors; gloo only host ones.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else None
    )
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    lengths = [int(s) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    outputs = [torch.empty_like(padded) for _ in range(world)]
    all_gather(outputs, padded, group=group)
    return [json.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outputs, lengths)]
