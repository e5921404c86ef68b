"""Inference: token generation over a paged (block) KV cache with continuous batching.

`generate(model, prompts, params)` is the one-call entry; `ContinuousBatcher` serves requests as
they arrive; `SamplingParams` / `choose_next` decide tokens; `BlockKVCache` holds keys and values;
the adapters in `models` run one cached forward step of the example GPT or a Hugging Face causal
LM (and any other model, uncached). `init_inference` (in `engine`) wraps a model for serving:
tensor parallelism, dtype and int8 weights, checkpoints; `hybrid.HybridEngine` is the training
engine that also generates (`hybrid_engine` config section). See docs/inference.md.
"""

from .engine import InferenceEngine, init_inference
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
    "InferenceEngine",
    "ModelAdapter",
    "OutOfBlocksError",
    "RecomputeAdapter",
    "SamplingParams",
    "adapter_for",
    "choose_next",
    "filtered_probs",
    "generate",
    "init_inference",
]
