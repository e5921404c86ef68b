"""The live model in its training dtype, whole: DeepSpeed's 16-bit state dict and
`save_16bit_model`. Takes the engine as an argument, as `engine_state` does."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..comm import barrier
from ..config.errors import ConfigError
from ..zero import GatheredParameters


def consolidated_state_dict(engine: Any, exclude_frozen_parameters: bool = False) -> dict:
    """The module's state dict with every parameter whole (collective at stage 3), and every
    expert of an expert-parallel MoE layer gathered under its global index."""
    module = engine.module
    with GatheredParameters(list(module.parameters())):  # stage 3: whole only inside, so copy
        state = {
            name: tensor.detach().clone().contiguous()
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
