"""Attention over a sequence group cut in two (`Topology.sequence_split`): Ulysses inside runs of
`ulysses_size` consecutive ranks, a ring across the runs. Ulysses alone (a ring of one) and the
ring alone (runs of one) are its two ends, so one function serves the three modes.

The layout that makes this work (`shard_sequence`): the sequence is first cut for the ring in the
load-balanced way (2R chunks, ring rank j holding chunks j and 2R-1-j), and each ring rank's block
is then cut contiguously over its Ulysses run. The Ulysses all-to-all gathers a run's pieces in rank
order, so afterwards every rank of run j holds ring block j whole, for 1/U of the heads, which is
exactly what causal `ring_attention` expects. Communication per layer: Ulysses' four all-to-alls
(each moving (U-1)/U of a tensor over U ranks) and the ring's R-1 key/value hops of a U-times longer
block carrying 1/U of the heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..comm.topology import SequenceGroups
from .ring import ring_attention, shard_load_balanced, unshard_load_balanced
from .ulysses import seq_all_to_all


def shard_sequence(tensor: Tensor, dim: int, rank: int, world_size: int, ring_size: int) -> Tensor:
    """Sequence rank `rank`'s piece of `tensor` along `dim` (see the module docstring). A
    `ring_size` of 1 is Ulysses' contiguous cut, `world_size` the ring's load-balanced one."""
    ulysses_size = world_size // ring_size
    ring_rank, ulysses_rank = divmod(rank, ulysses_size)
    block = shard_load_balanced(tensor, dim, ring_rank, ring_size) if ring_size > 1 else tensor
    if block.shape[dim] % ulysses_size:
        raise ValueError(
            f"the sequence length {tensor.shape[dim]} does not split over {world_size} "
            f"sequence ranks ({ring_size} ring blocks of {ulysses_size} pieces): pad it to a "
            f"multiple of {world_size * (2 if ring_size > 1 else 1)}"
        )
    return block.chunk(ulysses_size, dim)[ulysses_rank]


def unshard_sequence(pieces: list[Tensor], dim: int, ring_size: int) -> Tensor:
    """The whole sequence from every sequence rank's `shard_sequence` piece, listed by rank."""
    ulysses_size = len(pieces) // ring_size
    blocks = [
        torch.cat(pieces[j * ulysses_size : (j + 1) * ulysses_size], dim) for j in range(ring_size)
    ]
    return unshard_load_balanced(blocks, dim) if ring_size > 1 else blocks[0]


def kv_repeats(heads: int, kv_heads: int, size: int) -> int:
    """How often each key/value head is repeated for Ulysses over `size` ranks: once when `size`
    divides the key/value heads, `size // kv_heads` times when they divide `size` (DeepSpeed's
    rule for grouped-query models with fewer key/value heads than ranks; query head i still meets
    kv head i // (heads / kv_heads)). Other counts, and query heads `size` does not divide, are
    refused naming the numbers."""
    if heads % size:
        raise ValueError(
            f"Ulysses over {size} ranks splits the {heads} query heads evenly, and {size} does not "
            f"divide {heads}: choose a Ulysses size that divides the head count, or the config's "
            "sequence_parallel.mode ring (any head count)"
        )
    if kv_heads % size == 0:
        return 1
    if size % kv_heads == 0:
        return size // kv_heads
    raise ValueError(
        f"Ulysses over {size} ranks needs the {kv_heads} key/value heads to divide {size} or be "
        f"divisible by it: choose another Ulysses size, or the config's sequence_parallel.mode "
        "ring (any head count)"
    )


def sequence_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    groups: SequenceGroups,
    causal: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Attention over the whole sequence of the sequence group, each rank holding its
    `shard_sequence` piece, in `scaled_dot_product_attention`'s layout: query
    `[batch, heads, seq/P, head_dim]`, key and value `[batch, kv_heads, seq/P, head_dim]`. Returns
    `[batch, heads, seq/P, head_dim]`, this rank's positions."""
    ulysses = groups.ulysses_size > 1
    if ulysses:
        repeats = kv_repeats(query.shape[1], key.shape[1], groups.ulysses_size)
        if repeats > 1:
            key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
        query, key, value = (
            seq_all_to_all(t, 1, 2, groups.ulysses_group) for t in (query, key, value)
        )
    if groups.ring_size > 1:
        out = ring_attention(query, key, value, groups.ring_group, causal=causal, scale=scale)
    else:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=causal,
            scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    return seq_all_to_all(out, 2, 1, groups.ulysses_group) if ulysses else out
