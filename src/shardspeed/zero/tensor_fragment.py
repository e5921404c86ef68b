"""DeepSpeed's `safe_get_full_*` / `safe_set_full_*` / `safe_*_local_*`: one parameter's whole fp32
master value, gradient or optimizer state, read from (or written into) ZeRO's flat shards.

Under ZeRO stages 1 to 3 each rank holds a contiguous piece of every region of the flat layout, so
a parameter's values are spread over the ranks of its group: the full variants are collective
(every rank of the data-parallel group, or of the expert-data group for an expert, must call them)
and return the whole tensor in the parameter's shape on every rank. The local variants return or
take this rank's piece, flat (empty where the rank holds none of it).

Gradients are read as the engine holds them: accumulated in fp32 (fp16 for fp16 models), averaged
over the data-parallel group once the boundary micro-step's backward has finished, still multiplied
by the loss scale under fp16, and zeroed by the optimizer step. A parameter the engine does not
train (frozen, or no engine) has no master or state: the getters return None, and the gradient
getter returns `param.grad`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm import all_reduce

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]


def _owner(param: torch.Tensor) -> tuple[Any, int] | None:
    """(the engine's ZeRO optimizer, the parameter's index in it), or None if it trains none."""
    ref = getattr(param, "_shardspeed_optimizer", None)
    optimizer = ref() if ref is not None else None
    if optimizer is None or param not in optimizer.param_index:
        return None
    return optimizer, optimizer.param_index[param]


def _state_reader(optimizer: Any, key: str) -> Callable[[int], torch.Tensor]:
    def read(k: int) -> torch.Tensor:
        state = optimizer.state_of(k)
        if key not in state:
            known = ", ".join(sorted(state)) or "none yet: the optimizer has not stepped"
            raise KeyError(f"optimizer state {key!r} does not exist; this optimizer keeps: {known}")
        return state[key].reshape(-1)

    return read


def _state_writer(optimizer: Any, key: str) -> Callable[[int], torch.Tensor]:
    if optimizer.swapped is not None:
        raise RuntimeError(
            "writing optimizer states is not supported while they are offloaded to NVMe "
            "('zero_optimization.offload_optimizer.device': 'nvme')"
        )
    return _state_reader(optimizer, key)


def _master_reader(optimizer: Any) -> Callable[[int], torch.Tensor]:
    return optimizer.master_value


def _full(
    owner: tuple[Any, int], read: Callable[[int], torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    optimizer, i = owner
    pieces = optimizer.fragments(i)
    group, world = optimizer.fragment_group(i)
    shape, numel = optimizer.layout.shapes[i], optimizer.layout.numels[i]
    whole = torch.zeros(numel, dtype=dtype, device=optimizer.params[i].device)
    for k, start, offset, length in pieces:
        whole[start : start + length].copy_(read(k)[offset : offset + length])
    if world > 1:
        all_reduce(whole, group=group)  # each element is held by exactly one rank
    return whole.view(shape)


def _assign_full(
    owner: tuple[Any, int], value: torch.Tensor, target: Callable[[int], torch.Tensor]
) -> None:
    optimizer, i = owner
    flat = value.detach().reshape(-1)
    if flat.numel() != optimizer.layout.numels[i]:
        raise ValueError(
            f"the value has {flat.numel()} elements, the parameter "
            f"{optimizer.param_names[i]!r} {optimizer.layout.numels[i]}"
        )
    for k, start, offset, length in optimizer.fragments(i):
        target(k)[offset : offset + length].copy_(flat[start : start + length])


def _local(owner: tuple[Any, int], read: Callable[[int], torch.Tensor]) -> torch.Tensor:
    optimizer, i = owner
    pieces = optimizer.fragments(i)
    if not pieces:
        return torch.empty(0, device=optimizer.params[i].device)
    k, _, offset, length = pieces[0]
    return read(k)[offset : offset + length].clone()


def _assign_local(
    owner: tuple[Any, int], value: torch.Tensor, target: Callable[[int], torch.Tensor]
) -> None:
    optimizer, i = owner
    pieces = optimizer.fragments(i)
    length = pieces[0][3] if pieces else 0
    flat = value.detach().reshape(-1)
    if flat.numel() != length:
        raise ValueError(
            f"this rank holds {length} elements of {optimizer.param_names[i]!r}; the value has "
            f"{flat.numel()}"
        )
    if pieces:
        k, _, offset, _ = pieces[0]
        target(k)[offset : offset + length].copy_(flat)


def _write_masters(optimizer: Any, write: Callable[[Callable[[int], torch.Tensor]], None]) -> None:
    """Change masters through `write`, then hand the new values to the model on every rank."""
    if optimizer.sharded_params is not None and optimizer.master_flat is None:
        store = optimizer.sharded_params.store
        if not hasattr(store, "flat"):
            raise RuntimeError(
                "writing fp32 parameters is not supported while they are offloaded to NVMe "
                "('zero_optimization.offload_param.device': 'nvme')"
            )
    write(_master_reader(optimizer))
    optimizer.publish()  # collective: the model's copy (and every rank's gathered values)


# -- fp32 parameters ------------------------------------------------------------------------------


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    owner = _owner(param)
    return None if owner is None else _full(owner, _master_reader(owner[0]), torch.float32)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    owner = _owner(param)
    if owner is not None:
        _write_masters(owner[0], lambda target: _assign_full(owner, value, target))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    owner = _owner(param)
    return None if owner is None else _local(owner, _master_reader(owner[0]))


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    owner = _owner(param)
    if owner is not None:
        _write_masters(owner[0], lambda target: _assign_local(owner, value, target))


# -- gradients ------------------------------------------------------------------------------------


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    owner = _owner(param)
    if owner is None:
        return param.grad
    return _full(owner, owner[0].gradient_piece, owner[0].grad_dtype)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    owner = _owner(param)
    if owner is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    _assign_full(owner, value, owner[0].gradient_piece)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    owner = _owner(param)
    return None if owner is None else _local(owner, owner[0].gradient_piece)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    owner = _owner(param)
    if owner is not None:
        _assign_local(owner, value, owner[0].gradient_piece)


# -- optimizer states -----------------------------------------------------------------------------


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    owner = _owner(param)
    if owner is None:
        return None
    return _full(owner, _state_reader(owner[0], optim_state_key), torch.float32)


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    owner = _owner(param)
    if owner is not None:
        _assign_full(owner, value, _state_writer(owner[0], optim_state_key))


def safe_get_local_optimizer_state(
    param: torch.Tensor, optim_state_key: str
) -> torch.Tensor | None:
    owner = _owner(param)
    return None if owner is None else _local(owner, _state_reader(owner[0], optim_state_key))


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    owner = _owner(param)
    if owner is not None:
        _assign_local(owner, value, _state_writer(owner[0], optim_state_key))
