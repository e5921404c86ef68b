"""DeepSpeed's state offload: `offload_states` / `reload_states` / `empty_partition_cache`.

A trainer that shares its device with a generation engine (OpenRLHF, verl) moves its ZeRO states
to host memory while the other runs, and back before it trains again. The states are those of
the stores (stores.py), by DeepSpeed's names (`OffloadStateTypeEnum`):

- `optim_states`: the torch optimizer's state tensors (`MemoryStates`);
- `hp_params`: the fp32 masters where they are a copy (`CopiedMasters`; aliased masters are the
  parameters themselves and move with `lp_params`);
- `lp_params`: the parameters' buffer (`ReplicatedParams`), or stage 3's shard and its gathered
  persistent unit (`ShardedParams`);
- `lp_grads`: the gradient buffer or shard accumulator;
- `contiguous_grad_buffer`: the reducer's pooled bucket buffers (scratch between steps: released
  without a copy and refilled uninitialised).

States that `offload_optimizer` (masters and optimizer states) or `offload_param` (stage 3's
shard) keep on the host already are not moved, and neither is what lies off the training device.

A state moves by storage, not by tensor: its bytes are copied into one host buffer and the device
storage is resized to 0, so the stores' own views of it stay the same objects, and reloading
refills the same storage bit for bit (stage 3 releases gathered units the same way). What scripts
and checkpoints reach while the states are away (the model's parameters, the masters, the
optimizer's state dict) is pointed at the host copies meanwhile; the steps that need the device
storage (forward with the parameters away, backward, step, zero_grad) refuse until
`reload_states()`. DeepSpeed does neither: it fails later on mismatched devices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn


class OffloadDeviceEnum(str, Enum):
    """`offload_optimizer.device` / `offload_param.device`; members compare equal to the strings."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"

    def __str__(self) -> str:
        return self.value


class OffloadStateTypeEnum(str, Enum):
    """The kinds of state `offload_states(include=...)` moves (see the module docstring)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"

    def __str__(self) -> str:
        return self.value


_ALL = tuple(OffloadStateTypeEnum)
# What each action reads from the device storage of the states.
BACKWARD_NEEDS = (
    OffloadStateTypeEnum.lp_params,
    OffloadStateTypeEnum.lp_grads,
    OffloadStateTypeEnum.contiguous_grad_buffer,
)


@dataclass
class _Moved:
    """One state's storages away from the device, and the handles pointed at the host meanwhile."""

    storages: list[tuple[torch.Tensor, torch.Tensor | None, int]] = field(default_factory=list)
    # (parameter, its data, its grad) and (state dict, key, tensor), restored at reload.
    params: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=list
    )
    entries: list[tuple[dict, str, torch.Tensor]] = field(default_factory=list)


class StateOffload:
    """Moves a `ZeroOptimizer`'s states to host memory and back (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        stores: Any,
        reducer: Any,
        masters_on_host: bool,
    ) -> None:
        """`stores`: the optimizer's `Stores`; `reducer`: its `GradientReducer` (None: none);
        `masters_on_host`: `offload_optimizer` keeps the masters and states in host memory (or
        swap files)."""
        self.module, self.optimizer, self.stores = module, optimizer, stores
        self.reducer, self.masters_on_host = reducer, masters_on_host
        self.device = stores.grads.buffer().device  # the training device
        self.moved: dict[OffloadStateTypeEnum, _Moved] = {}
        self._forward_refusal: Any = None

    # -- DeepSpeed's surface ----------------------------------------------------------------------

    def offload_states(
        self,
        include: Iterable[OffloadStateTypeEnum | str] | OffloadStateTypeEnum | str | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> dict[OffloadStateTypeEnum, int]:
        """Move the states in `include` (None: all) to host memory, pinned when `pin_memory` and
        the states are on a CUDA device; states already away are left as they are. Returns, for
        each state asked for, the bytes of device memory this call released. With
        `non_blocking`, the copies may still run on return: synchronize before reading the host
        copies. Stage 3 first releases every gathered unit (`empty_partition_cache`)."""
        _check_device(device)
        states = _states(include)
        self.empty_partition_cache()
        released = {}
        for state in states:
            if state in self.moved:
                released[state] = 0
                continue
            moved = _Moved()
            released[state] = self._move_out(state, moved, pin_memory, non_blocking)
            self.moved[state] = moved
        if OffloadStateTypeEnum.lp_params in self.moved and self._forward_refusal is None:
            # Before any gather hook of stage 3, which would read the shard first.
            self._forward_refusal = self.module.register_forward_pre_hook(
                self._refuse_forward, prepend=True
            )
        _return_cached_memory(self.device)
        return released

    def reload_states(self, non_blocking: bool = False) -> dict[OffloadStateTypeEnum, int]:
        """Bring every offloaded state back to the device storage it left, bit for bit; returns
        the bytes restored to the device per state. With `non_blocking`, the copies run in order
        on the current stream (work issued after this call sees them)."""
        restored = {}
        # Last moved, first back: a parameter's handles then come back in the order they left.
        for state in reversed(list(self.moved)):
            restored[state] = _move_in(self.moved[state], non_blocking)
        self.moved.clear()
        if self._forward_refusal is not None:
            self._forward_refusal.remove()
            self._forward_refusal = None
        return restored

    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered unit now, except the persistent one (their shards stay;
        the next use gathers them again). Nothing is gathered on demand below stage 3."""
        self.stores.params.release_all()
        _return_cached_memory(self.device)

    # -- the optimizer's guards -------------------------------------------------------------------

    def require(self, action: str, states: Iterable[OffloadStateTypeEnum] = _ALL) -> None:
        """Refuse `action` while any of `states` is in host memory."""
        away = [str(s) for s in states if s in self.moved]
        if away:
            raise RuntimeError(
                f"{action} needs the device copies of {', '.join(away)}, which offload_states() "
                "moved to host memory: call reload_states() first"
            )

    def _refuse_forward(self, module: nn.Module, args: Any) -> None:
        self.require("forward", (OffloadStateTypeEnum.lp_params,))

    # -- moving -----------------------------------------------------------------------------------

    def _device_tensors(self, state: OffloadStateTypeEnum) -> list[torch.Tensor]:
        """The tensors behind `state` that this rank keeps in device memory."""
        stores, kinds = self.stores, OffloadStateTypeEnum
        if state == kinds.optim_states:
            if self.masters_on_host:
                return []
            return [v for s in self.optimizer.state.values() for v in _state_tensors(s)]
        if state == kinds.hp_params:
            flat = stores.masters.master_flat
            return [] if self.masters_on_host or flat is None else [flat]
        if state == kinds.lp_params:
            return stores.params.device_tensors()
        if state == kinds.lp_grads:
            return [stores.grads.buffer()]
        return list(self.reducer.pool) if self.reducer is not None else []

    def _move_out(
        self, state: OffloadStateTypeEnum, moved: _Moved, pin: bool, non_blocking: bool
    ) -> int:
        """Copy `state`'s storages to the host (scratch: not copied) and free them on the device;
        point the handles that scripts reach at the host copies. Returns the bytes freed."""
        scratch = state == OffloadStateTypeEnum.contiguous_grad_buffer
        pin = pin and self.device.type == "cuda"
        hosts: dict[int, torch.Tensor] = {}
        for tensor in _distinct_storages(self._device_tensors(state), self.device):
            storage = tensor.untyped_storage()
            host = None
            if not scratch:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes(tensor), non_blocking=non_blocking)
                hosts[storage.data_ptr()] = host
            moved.storages.append((tensor, host, storage.nbytes()))
        self._point_at_host(hosts, moved)
        for tensor, _, _ in moved.storages:
            tensor.untyped_storage().resize_(0)
        return sum(nbytes for _, _, nbytes in moved.storages)

    def _point_at_host(self, hosts: dict[int, torch.Tensor], moved: _Moved) -> None:
        """Parameters (the model's and the masters) over a moved storage now read the host copy,
        without a gradient; optimizer state entries become their host copies."""
        if not hosts:
            return
        params = {id(p): p for p in [*self.module.parameters(), *self.stores.masters.masters]}
        for p in params.values():
            data_host = hosts.get(p.untyped_storage().data_ptr())
            grad_away = p.grad is not None and p.grad.untyped_storage().data_ptr() in hosts
            if data_host is None and not grad_away:
                continue
            moved.params.append((p, p.data, p.grad))
            p.grad = None
            if data_host is not None:
                p.data = _typed(data_host, p.data)
        for entries in self.optimizer.state.values():
            for key, value in list(entries.items()):
                host = _state_host(value, hosts)
                if host is not None:
                    moved.entries.append((entries, key, value))
                    entries[key] = _typed(host, value)


def _move_in(moved: _Moved, non_blocking: bool) -> int:
    """Refill each storage on its device (from its host copy, where it has one) and point the
    handles back at it; the bytes restored."""
    for tensor, host, nbytes in moved.storages:
        tensor.untyped_storage().resize_(nbytes)
        if host is not None:
            _bytes(tensor).copy_(host, non_blocking=non_blocking)
    for p, data, grad in moved.params:
        p.data = data
        p.grad = grad
    for entries, key, value in moved.entries:
        entries[key] = value
    return sum(nbytes for _, _, nbytes in moved.storages)


def _states(include: Any) -> list[OffloadStateTypeEnum]:
    """`include` as a list of states (None: all), each name checked."""
    if include is None:
        return list(_ALL)
    if isinstance(include, str):  # one state (the enum's members are strings too)
        include = [include]
    states = []
    for name in include:
        try:
            states.append(OffloadStateTypeEnum(name))
        except ValueError:
            known = ", ".join(s.value for s in _ALL)
            raise ValueError(
                f"offload_states(include=...): unknown state {name!r}; the states are {known}"
            ) from None
    return list(dict.fromkeys(states))


def _check_device(device: Any) -> None:
    name = device.type if isinstance(device, torch.device) else device
    if name != OffloadDeviceEnum.cpu:  # the enum's members equal their names
        raise ValueError(
            f"offload_states(device={device!r}): states can only be moved to host memory; pass "
            "device=OffloadDeviceEnum.cpu (the default)"
        )


def _state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def _state_host(value: Any, hosts: dict[int, torch.Tensor]) -> torch.Tensor | None:
    if not isinstance(value, torch.Tensor):
        return None
    return hosts.get(value.untyped_storage().data_ptr())


def _distinct_storages(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """One tensor per storage on `device` that holds bytes (views share their storage; one
    already released holds none)."""
    seen: set[int] = set()
    distinct = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device != device or not storage.nbytes() or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        distinct.append(tensor)
    return distinct


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor` as bytes."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _typed(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`like`'s view (dtype, shape, strides, offset) of its storage, over the storage's host copy."""
    elements = host.view(like.dtype)
    return elements.as_strided(like.size(), like.stride(), like.storage_offset())


def _return_cached_memory(device: torch.device) -> None:
    """Give freed device memory back to the driver, for the other engine on the device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
