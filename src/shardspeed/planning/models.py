"""The models a dry run builds on the meta device: a Hugging Face `config.json`, a preset by family
and size, a transformers config object, or the user's own function that returns a module.

Presets are the published architectures' `config.json` figures, written here so that a plan needs
no download. Every model is built with `AutoModelForCausalLM.from_config` under the meta device:
shapes and dtypes only, no memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

# A tiny Llama-like model; Meta's Llama 3 / 3.1 configs (hidden, MLP, layers, heads); DeepSeek-V3's
# (671B, 37B active: 61 layers, the first 3 dense, 256 routed experts of which 8 per token, one
# shared).
PRESETS: dict[str, dict[str, Any]] = {
    # A tiny Llama-like model: to try a config's layout and start-up in seconds.
    "llama-tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    },
    "llama3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "llama3-405b": {
        **_LLAMA3,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
    },
}

# A ZeRO-3 config for the presets at real size: reduce buckets as large as a 70B layer's unit, so
# that each unit's gradients go out as one reduce-scatter, and a live-parameter limit that admits
# the embedding's unit. The micro-batch is the caller's.
ZERO3_AT_SCALE: dict[str, Any] = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 2e9,
        "stage3_max_live_parameters": 3e9,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}

# What a dry run can be given as its model.
ModelSource = str | os.PathLike | dict | Any | Callable[[], nn.Module]


def hf_config(source: ModelSource) -> Any | None:
    """The transformers config that `source` names (a preset, a `config.json` path or directory, a
    dict, a config object), or None when `source` is the user's own module factory."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if callable(source):
        return None
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text in PRESETS:
            source = PRESETS[text]
        else:
            path = os.path.join(text, "config.json") if os.path.isdir(text) else text
            if not os.path.isfile(path):
                raise ValueError(
                    f"model {text!r} is neither a config.json file, a directory holding one, nor "
                    f"a preset ({', '.join(PRESETS)})"
                )
            with open(path) as handle:
                source = json.load(handle)
    if not isinstance(source, dict) or "model_type" not in source:
        raise ValueError(
            "a model config needs its 'model_type' (as a Hugging Face config.json has it)"
        )
    values = dict(source)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def build_model(source: ModelSource, device: str | torch.device = "meta") -> nn.Module:
    """The model on `device` (the meta device for a dry run; a real one to train the same model):
    the user's factory called under it, or a causal LM built from its Hugging Face config."""
    config = hf_config(source)
    with torch.device(device):
        if config is None:
            return source()
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config)


def causal_lm_batch(micro_batch: int, seq_len: int, device: torch.device) -> dict[str, Any]:
    """A causal LM's micro-batch: token ids that are their own labels (values only on a real
    device; on the meta device shapes suffice)."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}
