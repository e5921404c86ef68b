"""Ring attention (context parallelism): each rank keeps its queries, and the key/value blocks of
the sequence travel around the ring of the sequence group while each rank attends to the block it
holds, merging blocks with an online softmax (running log-sum-exp).

Causal attention uses the load-balanced layout: the sequence is cut into 2P chunks and rank r holds
chunks r and 2P-1-r (`shard_load_balanced`). Then every step after the first costs every rank the
same half block: a block from an earlier rank meets all local queries with its early chunk only,
and a block from a later rank meets only the late local chunk, unmasked in both cases; the first
step (the rank's own block) is the one causally masked. Non-causal attention takes any layout.

Forward and backward are written out (`RingAttention`); no autograd runs through communication.
Forward sends the key/value block P-1 times; backward sends it P-1 times and the block's key/value
gradient accumulator (fp32) P times, the last hop delivering it to its owner. Every transfer is
posted before the step's compute and waited on after it. Grouped-query attention (fewer key/value
heads) is computed without repeating the key/value heads, so the ring carries only the real ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm

_EVERY = slice(None)


def shard_load_balanced(tensor: Tensor, dim: int, rank: int, world_size: int) -> Tensor:
    """Rank `rank`'s piece of `tensor` along `dim`: chunks `rank` and `2*world_size-1-rank` of
    2*world_size equal chunks, in that order. Sharding `torch.arange(seq)` gives the positions."""
    chunks = 2 * world_size
    if tensor.shape[dim] % chunks:
        raise ValueError(
            f"the sequence length {tensor.shape[dim]} is not a multiple of {chunks} (twice the "
            f"sequence-parallel size {world_size}); pad the sequence to a multiple of {chunks}"
        )
    pieces = tensor.chunk(chunks, dim)
    return torch.cat((pieces[rank], pieces[chunks - 1 - rank]), dim)


def unshard_load_balanced(shards: Sequence[Tensor], dim: int) -> Tensor:
    """The whole sequence from every rank's `shard_load_balanced` piece (listed by rank)."""
    halves = [shard.chunk(2, dim) for shard in shards]
    early = [half[0] for half in halves]
    late = [half[1] for half in reversed(halves)]
    return torch.cat(early + late, dim)


class _Ring:
    """This rank's place in the sequence group, and transfers to the next rank / from the previous."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        if self.size > 1:  # P2P ops name global ranks
            members = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
            self.next = members[(self.rank + 1) % self.size]
            self.previous = members[(self.rank - 1) % self.size]

    def post(self, sends: list[Tensor], receives: list[Tensor]) -> list[Any]:
        """Send `sends` to the next rank and receive `receives` from the previous, asynchronously.
        Every rank posts the same list shapes, so the k-th send meets the k-th receive."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.previous, self.group) for t in receives]
        return comm.batch_isend_irecv(ops) if ops else []


def _block(rank: int, source: int, local_len: int, causal: bool) -> tuple[slice, slice, bool]:
    """The local queries and the keys of `source`'s block that meet, and whether the causal mask
    applies (only on the own block, where both hold the same two chunks in position order)."""
    if not causal:
        return _EVERY, _EVERY, False
    if source == rank:
        return _EVERY, _EVERY, True
    half = local_len // 2
    if source < rank:  # its early chunk precedes both local chunks; its late one follows both
        return _EVERY, slice(0, half), False
    return slice(half, None), _EVERY, False  # both its chunks precede only the local late chunk


def _scores(query: Tensor, key: Tensor, scale: float, masked: bool) -> Tensor:
    """[b, kv_heads, group, q_len, k_len] scores; `query` is [b, kv_heads, group, q_len, d]."""
    scores = torch.matmul(query, key.unsqueeze(2).transpose(-1, -2).float()) * scale
    if masked:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _attend(
    query: Tensor, key: Tensor, value: Tensor, scale: float, masked: bool
) -> tuple[Tensor, Tensor]:
    """One block's softmax-normalised output and its log-sum-exp per query."""
    scores = _scores(query, key, scale, masked)
    lse = scores.logsumexp(-1)
    probs = (scores - lse.unsqueeze(-1)).exp()
    return torch.matmul(probs, value.unsqueeze(2).float()), lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block into the running output and log-sum-exp (views, updated in place)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_((lse - merged).exp().unsqueeze(-1))
    out.add_(block_out * (block_lse - merged).exp().unsqueeze(-1))
    lse.copy_(merged)


def _attend_backward(
    query: Tensor, key: Tensor, value: Tensor, grad_out: Tensor, lse: Tensor, delta: Tensor,
    scale: float, masked: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One block's share of dQ, and its dK, dV (summed over the query heads sharing a kv head)."""
    probs = (_scores(query, key, scale, masked) - lse.unsqueeze(-1)).exp()
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_out).sum(2)
    grad_probs = torch.matmul(grad_out, value.unsqueeze(2).transpose(-1, -2).float())
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale
    grad_query = torch.matmul(grad_scores, key.unsqueeze(2).float())
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), query).sum(2)
    return grad_query, grad_key, grad_value


class RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward. Shapes: query `[b, kv_heads, group, s, d]`
    (fp32), key and value `[b, kv_heads, s, d]`; returns the output like query and saves the
    log-sum-exp for the backward."""

    @staticmethod
    def forward(
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, group: Any, causal: bool, scale: float
    ) -> Tensor:
        ring = _Ring(group)
        local_len = query.shape[-2]
        held = torch.stack((key, value))
        out = lse = None
        for step in range(ring.size):
            if step < ring.size - 1:
                arriving = torch.empty_like(held)
                works = ring.post([held], [arriving])
            source = (ring.rank - step) % ring.size
            rows, cols, masked = _block(ring.rank, source, local_len, causal)
            block_out, block_lse = _attend(
                query[..., rows, :], held[0][..., cols, :], held[1][..., cols, :], scale, masked
            )
            if out is None:  # step 0 is the own block, which every query meets
                out, lse = block_out, block_lse
            else:
                _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if step < ring.size - 1:
                for work in works:
                    work.wait()
                held = arriving
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        query, key, value, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        local_len = query.shape[-2]
        delta = (grad_out * out).sum(-1)
        grad_query = torch.zeros_like(query)
        held = torch.stack((key, value))
        finished = None  # the previous step's kv-gradient accumulator, on its way to the next rank
        for step in range(ring.size):
            sends, receives = [], []
            if step < ring.size - 1:
                arriving = torch.empty_like(held)
                sends.append(held)
                receives.append(arriving)
            # The block's kv-gradient accumulator arrives from the ranks that met it earlier.
            if finished is None:
                accumulated = held.new_zeros(held.shape, dtype=torch.float32)
            else:
                accumulated = torch.empty_like(finished)
                sends.append(finished)
                receives.append(accumulated)
            works = ring.post(sends, receives)
            source = (ring.rank - step) % ring.size
            rows, cols, masked = _block(ring.rank, source, local_len, ctx.causal)
            block_query, block_key, block_value = _attend_backward(
                query[..., rows, :], held[0][..., cols, :], held[1][..., cols, :],
                grad_out[..., rows, :], lse[..., rows], delta[..., rows], ctx.scale, masked,
            )  # fmt: skip
            grad_query[..., rows, :] += block_query
            for work in works:
                work.wait()
            accumulated[0][..., cols, :] += block_key
            accumulated[1][..., cols, :] += block_value
            finished = accumulated
            if step < ring.size - 1:
                held = arriving
        if ring.size > 1:  # one more hop takes every accumulator home
            own = torch.empty_like(finished)
            for work in ring.post([finished], [own]):
                work.wait()
            finished = own
        return grad_query, finished[0].to(key.dtype), finished[1].to(value.dtype), None, None, None


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: Any = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Attention over the whole sequence of `group`, each rank holding a piece of it, in
    `scaled_dot_product_attention`'s layout: query `[batch, heads, seq/P, head_dim]`, key and value
    `[batch, kv_heads, seq/P, head_dim]` with `heads` a multiple of `kv_heads` (query head i uses
    kv head i // (heads / kv_heads), as SDPA's `enable_gqa`). With `causal`, the pieces must be in
    the load-balanced layout (`shard_load_balanced`). `scale` defaults to 1/sqrt(head_dim).
    Computed in fp32; returns query's dtype."""
    heads, kv_heads, local_len = query.shape[1], key.shape[1], query.shape[2]
    if heads % kv_heads:
        raise ValueError(
            f"query has {heads} heads and key/value {kv_heads}; the query heads must be a "
            "multiple of the key/value heads"
        )
    if key.shape[2] != local_len or value.shape[2] != local_len:
        raise ValueError(
            f"query, key and value hold {local_len}, {key.shape[2]} and {value.shape[2]} "
            "positions; ring attention needs each rank's three pieces to be the same length"
        )
    if causal and local_len % 2:
        raise ValueError(
            f"causal ring attention needs the load-balanced layout (two equal chunks per rank), "
            f"but this rank holds {local_len} positions; shard with shard_load_balanced"
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    grouped = query.float().unflatten(1, (kv_heads, heads // kv_heads))
    out = RingAttention.apply(grouped, key, value, group, causal, scale)
    return out.flatten(1, 2).to(query.dtype)
