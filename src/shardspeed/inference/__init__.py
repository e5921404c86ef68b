"""Inference: token generation over a paged (block) KV cache with continuous batching.

`generate(model, prompts, params)` is the one-call entry; `ContinuousBatcher` serves requests as
they arrive; `SamplingParams` / `choose_next` decide tokens; `BlockKVCache` holds keys and values;
the adapters in `models` run one cached forward step of the example GPT or a Hugging Face causal
LM (and any other model, uncached).
"""

from .generation import ContinuousBatcher, GenerationStats, generate
from .kv_cache import BlockKVCache, OutOfBlocksError
from .models import GPTAdapter, HFCausalLMAdapter, ModelAdapter, RecomputeAdapter, adapter_for
from .sampling import SamplingParams, choose_next, filtered_probs

__all__ = [
    "BlockKVCache",
    "ContinuousBatcher",
    "GPTAdapter",
    "GenerationStats",
    "HFCausalLMAdapter",
    "ModelAdapter",
    "OutOfBlocksError",
    "RecomputeAdapter",
    "SamplingParams",
    "adapter_for",
    "choose_next",
    "filtered_probs",
    "generate",
]
