"""Attention on the meta device as a GPU runs it.

On meta tensors torch's `scaled_dot_product_attention` takes its math path, which keeps the whole
(heads x sequence x sequence) probabilities in fp32 for backward: a GPU's flash kernel keeps the
output and one fp32 log-sum-exp per row instead. A dry run stands in the flash kernel's own forward
and backward operators (their meta shapes and the FLOP counter's rules for them), so activations
and FLOPs are what a GPU run holds and does. Grouped-query attention keeps its few key/value heads
(flash reads them in place); their gradients are summed over the query heads that share them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None) -> torch.Tensor:  # fmt: skip
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        heads, kv_heads = q.shape[-3], k.shape[-3]
        wide = [t.unsqueeze(-3).expand(*t.shape[:-2], heads // kv_heads, *t.shape[-2:])
                .flatten(-4, -3) for t in (k, v)]  # fmt: skip
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        none = torch.empty(0, device=q.device)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, *wide, out, lse, none, none, seq_q, seq_k, 0.0, ctx.causal, none, none,
            scale=ctx.scale,
        )  # fmt: skip
        narrow = [g.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3) for g in (gk, gv)]
        return gq, *narrow, None, None


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
    del dropout_p, enable_gqa  # dropout changes no shape; flash takes grouped heads as they are
    # A mask (padding, or a causal mask written out) is attention over the same shapes.
    causal = is_causal or attn_mask is not None
    width = value.shape[-1]
    if width == query.shape[-1]:
        return _Flash.apply(query, key, value, causal, scale)
    # Flash takes one head size: a narrower value (DeepSeek's MLA) is padded to the query's and
    # the output cut back, as transformers does for its flash-attention path.
    wide = F.pad(value, [0, query.shape[-1] - width])
    return _Flash.apply(query, key, wide, causal, scale)[..., :width]


@contextmanager
def flash_on_meta() -> Iterator[None]:
    """While active, `scaled_dot_product_attention` on meta tensors runs as the flash kernel, and
    a meta tensor's truth value (a branch on data: transformers asking whether a batch is packed
    or has no padding) is True, the branch of a plain batch of whole sequences. Both are swapped
    in as attributes, not as a torch function mode: activation checkpointing recomputes on the
    autograd engine's own thread, where a mode would not be active. Real tensors are untouched."""
    sdpa, truth = F.scaled_dot_product_attention, torch.Tensor.__bool__

    def attention(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return (_attention if query.is_meta else sdpa)(query, *args, **kwargs)

    def as_bool(tensor: torch.Tensor) -> bool:
        return True if tensor.is_meta else truth(tensor)

    F.scaled_dot_product_attention, torch.Tensor.__bool__ = attention, as_bool
    try:
        yield
    finally:
        F.scaled_dot_product_attention, torch.Tensor.__bool__ = sdpa, truth
