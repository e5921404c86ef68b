"""Ulysses sequence parallelism (DeepSpeed's `DistributedAttention`): trade a sequence shard for a
head shard with one all-to-all, attend over the whole sequence, trade back.

Each rank of the sequence group enters with q, k, v for its contiguous piece of the sequence and
all heads. After the all-to-all it holds the whole sequence for 1/P of the heads, so any local
attention (causal or not, a fused kernel, a mask) runs unchanged; a second all-to-all returns the
output to the sequence layout. Per layer that is four all-to-alls forward (q, k, v, output) and
four backward, each moving 1/P of the tensor's bytes off every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import comm


def _all_to_all(tensor: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
    """Split `scatter_dim` into P equal pieces, send piece j to group rank j, and join what arrives
    along `gather_dim` in rank order (rank j's piece j-th)."""
    size = comm.get_world_size(group)
    if size == 1:
        return tensor
    # One contiguous buffer whose leading dim is the destination rank, as all_to_all_single wants.
    outgoing = tensor.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    incoming = torch.empty_like(outgoing)
    comm.all_to_all_single(incoming, outgoing, group=group)
    return incoming.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


def _dims(scatter_idx: int, gather_idx: int, batch_dim_idx: int | None) -> tuple[int, int]:
    """The dims to scatter and gather. Without `batch_dim_idx` they are the two indices; with it,
    DeepSpeed's reading of 4-D `[b, s, h, d]` / `[s, b, h, d]`: a `scatter_idx` below 2 scatters the
    sequence and gathers the heads (dim 2), any other scatters the heads and gathers the sequence."""
    if batch_dim_idx is None:
        return scatter_idx, gather_idx
    seq_dim = 1 - batch_dim_idx
    return (seq_dim, 2) if scatter_idx < 2 else (scatter_idx, seq_dim)


class SeqAllToAll(torch.autograd.Function):
    """The all-to-all as an autograd function (DeepSpeed's `_SeqAllToAll`, same arguments:
    group, tensor, scatter_idx, gather_idx, then optionally batch_dim_idx and DeepSpeed's overlap
    arguments, which are accepted and unused). The gradient takes the inverse trade (scatter the
    gathered dim, gather the scattered one)."""

    @staticmethod
    def forward(
        ctx: Any,
        group: Any,
        tensor: Tensor,
        scatter_idx: int,
        gather_idx: int,
        *batch_dim_and_overlap: Any,
    ) -> Tensor:
        batch_dim_idx = batch_dim_and_overlap[0] if batch_dim_and_overlap else None
        ctx.group, ctx.dims = group, _dims(scatter_idx, gather_idx, batch_dim_idx)
        ctx.unused_inputs = 2 + len(batch_dim_and_overlap)  # no gradient for any of these
        return _all_to_all(tensor, *ctx.dims, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        inverse = _all_to_all(grad, gather_dim, scatter_dim, ctx.group)
        return (None, inverse) + (None,) * ctx.unused_inputs


def seq_all_to_all(tensor: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
    """Differentiable all-to-all over `group`: `scatter_dim` shrinks P-fold, `gather_dim` grows."""
    return SeqAllToAll.apply(group, tensor, scatter_dim, gather_dim)


def _apply_rotary(tensor: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary embedding on the first `cos.shape[-1]` features; the rest pass through."""
    width = cos.shape[-1]
    rotated, rest = tensor[..., :width], tensor[..., width:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1)


class DistributedAttention(nn.Module):
    """DeepSpeed's Ulysses attention: `local_attention(q, k, v, *args, **kwargs)` sees the whole
    sequence and 1/P of the heads, where P is the size of `sequence_process_group`.

    Inputs are 4-D, `[batch, seq/P, heads, head_dim]` (`batch_dim_idx=0`) or
    `[seq/P, batch, heads, head_dim]` (`batch_dim_idx=1`), each rank holding a contiguous piece of
    the sequence in rank order. `scatter_idx` is the heads dim (2, as in DeepSpeed). As in
    DeepSpeed, the sequence dim follows from `batch_dim_idx` (the other one of dims 0 and 1);
    `gather_idx` is kept for DeepSpeed's signature. The output has the inputs' layout.

    Heads are split evenly: the query heads and the key/value heads (fewer under grouped-query
    attention) must each be a multiple of P. DeepSpeed instead splits a head count that P does not
    divide unevenly when it exceeds P, keyed on one head count remembered process-wide (so a
    query and a key with different counts are not told apart), and asserts when it is below P;
    here both are refused up front, naming the counts. `ring_attention` takes any head count.

    `sp_stream` (DeepSpeed's overlap of the all-to-alls on a side stream) is accepted and ignored:
    the all-to-alls run on the current stream.
    """

    def __init__(
        self,
        local_attention: nn.Module | Callable[..., Tensor],
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(
                f"DistributedAttention got scatter_idx={scatter_idx}; the heads must be dim 2 of "
                "[batch, seq, heads, head_dim] or [seq, batch, heads, head_dim] (scatter_idx=2)"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: tuple[Tensor, Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        """Attend over the whole sequence. `rotary_pos_emb`, if given, is `(cos, sin)` for the
        whole sequence, sequence first (`[seq, 1, 1, rot_dim]`), applied to q and k after the
        all-to-all, when each rank holds every position."""
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 or 1 (the batch dim), not {batch_dim_idx}")
        seq_dim, heads_dim = 1 - batch_dim_idx, self.scatter_idx
        self._check_heads(query, key, value)
        q, k, v = (seq_all_to_all(t, heads_dim, seq_dim, self.spg) for t in (query, key, value))
        if rotary_pos_emb is not None:
            cos, sin = (f if batch_dim_idx == 1 else f.transpose(0, 1) for f in rotary_pos_emb)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, seq_dim, heads_dim, self.spg)

    def _check_heads(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        size = comm.get_world_size(self.spg)
        counts = {"query": query.shape[2], "key": key.shape[2], "value": value.shape[2]}
        uneven = {name: n for name, n in counts.items() if n % size}
        if uneven:
            listed = ", ".join(f"{name} has {n}" for name, n in uneven.items())
            raise ValueError(
                f"Ulysses sequence parallelism over {size} ranks splits the heads evenly, but "
                f"{listed} heads (not a multiple of {size}); use a sequence-parallel size that "
                "divides every head count, repeat the key/value heads up to a multiple of it, or "
                "use ring_attention, which takes any head count"
            )
