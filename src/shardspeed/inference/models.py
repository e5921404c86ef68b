"""Adapters that run one step of a causal language model against a `BlockKVCache`.

`adapter.forward(ids, seq_ids, cache)` feeds each sequence its new tokens (a whole prompt at
prefill, one token per decode step), stores their keys and values in the cache and returns the
logits of each sequence's last new token, [B, vocab]. Sequences of different lengths batch
together: the cache gathers them right-aligned (see kv_cache.py) and the adapter masks the left
padding. Sequences with different numbers of new tokens run in separate groups, one forward each,
so that the new tokens of a forward occupy the same columns in every row; a decode step (one token
each) is therefore always a single batched forward.

- `GPTAdapter`: the repository's example GPT (examples/gpt.py), recognised by its attributes; its
  modules are called one by one with cached attention.
- `HFCausalLMAdapter`: a Hugging Face decoder-only model with full attention in every layer
  (GPT-2, Llama-like, ...); the model's own forward runs with a `transformers` Cache backed by the
  block cache, a 2D padding mask and explicit position ids.
- `RecomputeAdapter`: anything else mapping ids [B, T] to logits [B, T, V] (or an output with
  `.logits`); it keeps each sequence's tokens and reruns the whole sequence every step, with no
  KV cache: correct for any causal model, and quadratic in the length.

`adapter_for(model)` picks the first that fits. Adapters expect the model in eval mode and grads
off; `generate` and `ContinuousBatcher` see to both.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import BlockKVCache

__all__ = ["GPTAdapter", "HFCausalLMAdapter", "ModelAdapter", "RecomputeAdapter", "adapter_for"]

TokenIds = Sequence[Sequence[int]] | torch.Tensor


def _rows(ids: TokenIds) -> list[list[int]]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2:
            raise ValueError(f"token ids as a tensor must be [B, T], got shape {tuple(ids.shape)}")
        return ids.tolist()
    rows = [[int(t) for t in row] for row in ids]
    if any(not row for row in rows):
        raise ValueError("every sequence needs at least one new token")
    return rows


def _logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


class ModelAdapter:
    """One forward step of `model` for a batch of cached sequences (see the module docstring).

    Subclasses implement `_forward_group` for new-token tensors of one width and set the cache
    geometry (`num_layers`, `num_kv_heads`, `head_dim`) and `max_positions`, the most positions
    a sequence may occupy (None: no limit the adapter knows of).
    """

    uses_cache = True
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int | None = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        param = next(self.model.parameters(), None)
        return param.dtype if param is not None else torch.get_default_dtype()

    def make_cache(self, num_blocks: int, block_size: int = 16) -> BlockKVCache:
        """A block cache shaped for this model, in its dtype and on its device."""
        return BlockKVCache(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )

    def forward(
        self, ids: TokenIds, seq_ids: Sequence[Hashable], cache: BlockKVCache | None
    ) -> torch.Tensor:
        """Feed each sequence its new tokens; logits [B, V] of each one's last new token."""
        rows = _rows(ids)
        if len(rows) != len(seq_ids):
            raise ValueError(f"{len(rows)} rows of token ids for {len(seq_ids)} sequences")
        if self.uses_cache and cache is None:
            raise ValueError(f"{type(self).__name__} needs a BlockKVCache (see make_cache)")
        groups: dict[int, list[int]] = {}
        for b, row in enumerate(rows):
            groups.setdefault(len(row), []).append(b)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for members in groups.values():
            group_ids = torch.tensor([rows[b] for b in members], device=self.device)
            logits = self._forward_group(group_ids, [seq_ids[b] for b in members], cache)
            for i, b in enumerate(members):
                out[b] = logits[i]
        return torch.stack(out)

    def _forward_group(
        self, ids: torch.Tensor, seq_ids: list[Hashable], cache: BlockKVCache | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def free(self, seq_id: Hashable) -> None:
        """Forget a finished sequence's adapter-side state (the cache's blocks are freed apart)."""


def _positions(cache: BlockKVCache, seq_ids: list[Hashable], width: int) -> torch.Tensor:
    past = torch.tensor([cache.length(s) for s in seq_ids], device=cache.device)
    return past[:, None] + torch.arange(width, device=cache.device)


def _right_aligned_mask(lengths: torch.Tensor, new: int, longest: int) -> torch.Tensor:
    """bool [B, 1, new, longest]: query t (column longest - new + t) sees key column j when j is
    one of the row's tokens (j >= longest - length) and not in its future (j <= its own column)."""
    cols = torch.arange(longest, device=lengths.device)
    query_cols = longest - new + torch.arange(new, device=lengths.device)
    causal = cols[None, :] <= query_cols[:, None]
    valid = cols[None, :] >= (longest - lengths)[:, None]
    return (causal[None] & valid[:, None, :])[:, None]


def _is_example_gpt(model: nn.Module) -> bool:
    if not all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "lm_head")):
        return False
    return all(
        all(hasattr(block, a) for a in ("ln_1", "attn", "ln_2", "mlp"))
        and all(hasattr(block.attn, a) for a in ("qkv", "proj", "n_head"))
        for block in model.blocks
    )


class GPTAdapter(ModelAdapter):
    """The example GPT (examples/gpt.py) with cached attention.

    Runs the model's own modules in its order (embeddings plus learned positions at each token's
    true position, then per block ln_1, fused qkv, attention over the cached keys, proj, ln_2,
    mlp, then ln_f and lm_head), so outputs match `model(idx)` up to float rounding. Dropout is
    not applied: the adapter is for eval mode. Positions are limited by `wpe`: a sequence may not
    grow past `wpe.num_embeddings` tokens (the model's own `generate` crops its context instead).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if not _is_example_gpt(model):
            raise TypeError(f"{type(model).__name__} does not have the example GPT's structure")
        attn = model.blocks[0].attn
        self.num_layers = len(model.blocks)
        self.num_kv_heads = attn.n_head
        self.head_dim = model.wte.embedding_dim // attn.n_head
        self.max_positions = model.wpe.num_embeddings

    def _forward_group(
        self, ids: torch.Tensor, seq_ids: list[Hashable], cache: BlockKVCache | None
    ) -> torch.Tensor:
        model = self.model
        batch, new = ids.shape
        pos = _positions(cache, seq_ids, new)
        if int(pos.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(pos.max())} is past the model's {self.max_positions} positions"
            )
        x = model.wte(ids) + model.wpe(pos)
        width = x.size(-1)
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            q, k, v = attn.qkv(block.ln_1(x)).split(width, dim=2)
            q, k, v = (
                t.view(batch, new, attn.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v)
            )
            cache.append_batch(seq_ids, layer, k, v)
            keys, values, lengths = cache.gather(seq_ids, layer)
            mask = _right_aligned_mask(lengths, new, keys.size(2))
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + attn.proj(y.transpose(1, 2).reshape(batch, new, width))
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(model.ln_f(x[:, -1]))


@functools.cache
def _hf_cache_class() -> type:
    """The `transformers` Cache over a block cache, defined on first use so that this module
    imports without transformers."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class BlockCacheLayer(CacheLayerMixin):
        """One layer's view of a block cache for one forward of `seq_ids`.

        `update` appends the new keys/values and returns the layer's whole right-aligned history,
        [B, kv_heads, past + q, head_dim]. `past` is the longest history before the forward: the
        mask functions take `get_mask_sizes` (kv length past + q, offset 0) and the query offset
        (`get_seq_length`, read before the first layer runs) from it, which places the q new
        tokens in the last q columns, where `gather` puts them.
        """

        is_sliding = False

        def __init__(self, cache: BlockKVCache, layer: int, seq_ids: list[Hashable], past: int):
            super().__init__()
            self.cache, self.layer, self.seq_ids, self.seen = cache, layer, seq_ids, past
            # Nothing to allocate lazily: the block cache is preallocated.
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.append_batch(self.seq_ids, self.layer, key_states, value_states)
            self.seen += key_states.size(2)
            keys, values, _ = self.cache.gather(self.seq_ids, self.layer)
            return keys.to(key_states.dtype), values.to(value_states.dtype)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.seen

        def get_max_length(self) -> int:
            return -1

    class BlockCache(Cache):
        """A `transformers` Cache whose layers read and write a `BlockKVCache`; made per forward."""

        def __init__(self, cache: BlockKVCache, seq_ids: list[Hashable], past: int):
            layers = [BlockCacheLayer(cache, i, seq_ids, past) for i in range(cache.num_layers)]
            super().__init__(layers=layers)

    return BlockCache


def _is_hf_causal_lm(model: nn.Module) -> bool:
    # A transformers model's class came from the transformers package, so it is imported already.
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    config = model.config.get_text_config()
    return model.can_generate() and not getattr(config, "is_encoder_decoder", False)


def _full_attention_only(model: nn.Module) -> bool:
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    return not layer_types or all(t == "full_attention" for t in layer_types)


def _tp_size(model: nn.Module) -> int:
    """Ranks the model's attention heads are split over: the group of its first key projection
    if that is split by columns (automatic tensor parallelism, also under int8), else 1."""
    from ..tensor_parallel.layers import ColumnParallelLinear
    from ..tensor_parallel.mappings import world_size

    for name, module in model.named_modules():
        if re.search(r"(^|\.)(k_proj|c_attn|key|qkv)$", name):
            column = isinstance(module, ColumnParallelLinear) or (
                getattr(module, "parallel", None) == "column"
            )
            return world_size(module.group) if column else 1
    return 1


class HFCausalLMAdapter(ModelAdapter):
    """A Hugging Face decoder-only LM run through its own forward with a block-cache `Cache`.

    Each forward gets `attention_mask` [B, past + q] (0 on each row's left padding), `position_ids`
    (each token's true position, so learned and rotary positions ignore the padding), the cache
    (as `cache=`, or `past_key_values=` on a transformers without the rename) and
    `logits_to_keep=1` where the model takes it. Grouped-query attention needs nothing special:
    the cache holds `num_key_value_heads` heads and the model repeats them itself.

    Supported: every layer full attention (no sliding-window, chunked or linear-attention
    layers; `adapter_for` sends those models to `RecomputeAdapter`). `max_positions` is the config's
    `max_position_embeddings`, also enforced for rotary models, which were not trained past it.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if not _is_hf_causal_lm(model):
            raise TypeError(f"{type(model).__name__} is not a Hugging Face decoder-only LM")
        if not _full_attention_only(model):
            raise TypeError(f"{type(model).__name__} has layers that are not full attention")
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # Split by tensor parallelism, a rank holds 1/t of the heads (and caches only those).
        self.num_kv_heads = (getattr(config, "num_key_value_heads", None) or heads) // _tp_size(
            model
        )
        self.max_positions = getattr(config, "max_position_embeddings", None)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params

    def _forward_group(
        self, ids: torch.Tensor, seq_ids: list[Hashable], cache: BlockKVCache | None
    ) -> torch.Tensor:
        new = ids.size(1)
        lengths = torch.tensor([cache.length(s) for s in seq_ids], device=self.device)
        past = int(lengths.max())
        cols = torch.arange(past + new, device=self.device)
        attention_mask = (cols[None, :] >= (past - lengths)[:, None]).long()
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": attention_mask,
            "position_ids": lengths[:, None] + torch.arange(new, device=self.device),
            "use_cache": True,
            self._cache_arg: _hf_cache_class()(cache, seq_ids, past),
        }
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        return _logits_of(self.model(**kwargs))[:, -1]


class RecomputeAdapter(ModelAdapter):
    """Any causal LM as a function of ids [B, T] -> logits [B, T, V] (or an output with .logits).

    No KV cache: the adapter keeps each sequence's tokens and reruns the whole sequence every
    step, batching sequences of equal total length. Correct for any causal model and the
    reference the cached adapters are tested against, but each step costs a full forward over
    the sequence. `use_cache=False` is passed where the forward takes it, so a Hugging Face model
    does not build a cache of its own that would be thrown away.
    """

    uses_cache = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._tokens: dict[Hashable, list[int]] = {}
        forward = getattr(model, "forward", model)
        try:
            self._no_cache_arg = "use_cache" in inspect.signature(forward).parameters
        except (TypeError, ValueError):
            self._no_cache_arg = False

    def make_cache(self, num_blocks: int, block_size: int = 16) -> BlockKVCache:
        raise TypeError("RecomputeAdapter keeps no KV cache")

    def forward(
        self, ids: TokenIds, seq_ids: Sequence[Hashable], cache: BlockKVCache | None = None
    ) -> torch.Tensor:
        rows = _rows(ids)
        if len(rows) != len(seq_ids):
            raise ValueError(f"{len(rows)} rows of token ids for {len(seq_ids)} sequences")
        for seq_id, row in zip(seq_ids, rows):
            self._tokens.setdefault(seq_id, []).extend(row)
        # Grouped by whole length, since every step reruns each sequence from its first token.
        return super().forward([self._tokens[s] for s in seq_ids], seq_ids, None)

    def _forward_group(
        self, ids: torch.Tensor, seq_ids: list[Hashable], cache: BlockKVCache | None
    ) -> torch.Tensor:
        kwargs = {"use_cache": False} if self._no_cache_arg else {}
        return _logits_of(self.model(ids, **kwargs))[:, -1]

    def free(self, seq_id: Hashable) -> None:
        self._tokens.pop(seq_id, None)


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The cached adapter that fits `model`, or `RecomputeAdapter` when none does."""
    if _is_example_gpt(model):
        return GPTAdapter(model)
    if _is_hf_causal_lm(model) and _full_attention_only(model):
        return HFCausalLMAdapter(model)
    return RecomputeAdapter(model)
