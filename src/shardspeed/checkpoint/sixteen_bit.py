"""The live model whole: DeepSpeed's 16-bit state dict and `save_16bit_model`, and its weights
streamed a bucket at a time (`stream_weights`) for a trainer that pushes fresh weights to a
generator (vLLM, SGLang) after each step, and for the hybrid engine's inference copy. Takes the
engine as an argument, as `engine_state` does."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..comm import barrier
from ..config.errors import ConfigError
from ..tensor_parallel.layers import whole
from ..zero import GatheredParameters
from .engine_state import require_states


def consolidated_state_dict(engine: Any, exclude_frozen_parameters: bool = False) -> dict:
    """The module's state dict with every parameter whole (collective at stage 3; tensor-parallel
    pieces and Hugging Face experts' runs joined), and every expert of an expert-parallel MoE
    layer gathered under its global index."""
    require_states(engine, "consolidating the state dict")
    module = engine.module
    topology, splits = engine.topology, engine.experts.splits
    with GatheredParameters(list(module.parameters())):  # stage 3: whole only inside, so copy
        state = {
            name: (
                _whole(tensor, name, topology, splits, None)
                if isinstance(tensor, nn.Parameter)
                else tensor.detach()
            )
            .clone()
            .contiguous()
            for name, tensor in module.state_dict(keep_vars=True).items()
            if not (
                exclude_frozen_parameters
                and isinstance(tensor, nn.Parameter)
                and not tensor.requires_grad
            )
        }
    for prefix, layer in engine.moe_layers.items():
        if layer.ep_size > 1:  # this rank holds some experts: gather them all
            stem = f"{prefix}.deepspeed_moe.experts." if prefix else "deepspeed_moe.experts."
            experts = layer.all_experts_state_dict(f"{prefix}." if prefix else "")
            state = {n: t for n, t in state.items() if not n.startswith(stem)}
            state.update(experts)
    return state


def save_16bit_model(
    engine: Any, save_dir: str, save_filename: str, exclude_frozen_parameters: bool
) -> bool:
    """Write the whole model in its training dtype to one safetensors file (rank 0 writes).

    Collective: every rank must call it. At stage 3 the parameters are gathered, which needs
    `zero_optimization.stage3_gather_16bit_weights_on_model_save` (DeepSpeed silently skips the
    save without it; here it is an error). The file is written under a temporary name and
    renamed, so a crash never leaves a half-written model behind.
    """
    if not save_filename.endswith(".safetensors"):
        raise ValueError(
            f"save_filename {save_filename!r}: shardspeed writes safetensors only (no pickles); "
            "use a name ending in .safetensors"
        )
    zero = engine.run_config.zero_optimization
    if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        raise ConfigError(
            "save_16bit_model() at ZeRO stage 3 gathers every parameter: set "
            "'zero_optimization.stage3_gather_16bit_weights_on_model_save': true"
        )
    state: dict[str, torch.Tensor] = consolidated_state_dict(engine, exclude_frozen_parameters)
    if engine.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        partial = f"{path}.partial"
        save_file(state, partial, metadata={"format": "pt"})
        os.replace(partial, path)
    barrier()
    return True


def stream_weights(
    engine: Any, bucket_bytes: int | None = None, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The module's current weights, whole, a bucket at a time: each item is a list of
    (name, tensor), by gather unit at ZeRO-3 (module order within each), else in module order.
    Collective: every rank iterates to the end.

    Parameters are grouped as they are gathered: by ZeRO-3 gather unit (a layer or block), else
    one group per parameter; consecutive groups share an item while it stays within
    `bucket_bytes` (None: one group per item; a group larger than the bucket is an item alone).
    Tensor-parallel pieces are joined. Tensors are in `dtype` (default: the training dtype); in
    that dtype they are the gathered memory itself, so an item is valid until the next one is
    asked for, when its units are released: the extra memory held is the item's."""
    if any(layer.ep_size > 1 for layer in engine.moe_layers.values()):
        raise ValueError(
            "stream_weights does not gather expert-parallel experts: use "
            "engine._zero3_consolidated_16bit_state_dict() for a model with them"
        )
    require_states(engine, "stream_weights")
    names = {p: n for n, p in engine.module.named_parameters()}
    yield from gathered_items(engine, _items(engine, list(names), bucket_bytes), names, dtype)


def gathered_items(
    engine: Any,
    items: Sequence[Sequence[nn.Parameter]],
    names: dict[nn.Parameter, str],
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each of `items` (lists of the module's parameters) gathered whole, named, tensor-parallel
    pieces joined, in `dtype`; released when the next is asked for."""
    topology = engine.topology
    experts = engine.experts.splits
    for item in items:
        with GatheredParameters(list(item)):
            yield [(names[p], _whole(p, names[p], topology, experts, dtype)) for p in item]


def _whole(
    p: nn.Parameter,
    name: str,
    topology: Any,
    experts: dict[str, tuple[int, int, Any, Any]],
    dtype: torch.dtype | None,
) -> torch.Tensor:
    tensor = p.detach().to(dtype or p.dtype)
    if name in experts:  # a run of a Hugging Face block's experts (or of moved experts)
        _, _, group, in_order = experts[name]
        return in_order(whole(tensor, 0, group))
    if not getattr(p, "tensor_model_parallel", False) or topology.tp_world_size == 1:
        return tensor
    return whole(tensor, p.partition_dim, topology.tp_group, getattr(p, "partition_stride", 1))


def _items(
    engine: Any, params: list[nn.Parameter], bucket_bytes: int | None
) -> list[list[nn.Parameter]]:
    """The parameters grouped by gather unit (ZeRO-3) or one by one, groups joined up to
    `bucket_bytes`."""
    units = [unit.params for shards in engine.parameter_shards for unit in shards.units]
    in_units = {p for unit in units for p in unit}
    groups = [list(unit) for unit in units if unit]
    groups += [[p] for p in params if p not in in_units]  # whole ones (below stage 3, say)
    if bucket_bytes is None:
        return groups
    items: list[list[nn.Parameter]] = []
    size = 0
    for group in groups:
        group_bytes = sum(_numel(p) * p.element_size() for p in group)
        if items and size + group_bytes <= bucket_bytes:
            items[-1] += group
            size += group_bytes
        else:
            items.append(list(group))
            size = group_bytes
    return items


def _numel(p: nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))
