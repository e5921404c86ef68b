"""Sequence parallelism (shardspeed.sequence): Ulysses and ring attention on real gloo ranks equal
`scaled_dot_product_attention` over the whole sequence in one process, forward and gradients.

Tolerance: fp32, atol 1e-5. Every rank builds the same whole q, k, v from one seed, so the
reference is exact; the parallel forms differ from it only by summation order (online-softmax
merges, blockwise gradient sums), which for these tiny, unit-scale tensors stays near 1e-7.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardspeed import comm
from shardspeed.sequence import (
    DistributedAttention,
    ring_attention,
    seq_all_to_all,
    sequence_attention,
    shard_load_balanced,
    shard_sequence,
    unshard_load_balanced,
    unshard_sequence,
)

ATOL = 1e-5


def _whole(batch: int, heads: int, kv_heads: int, seq: int, dim: int) -> list[torch.Tensor]:
    """q, k, v in SDPA's layout [batch, heads, seq, dim], and an output gradient; same on every rank."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim)]
    shapes.append(shapes[0])
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _reference(q, k, v, grad_out, causal: bool, rotary=None) -> list[torch.Tensor]:
    """Output and dq, dk, dv of whole-sequence attention in one process."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    q_in, k_in = (q, k) if rotary is None else (rotary(q), rotary(k))
    out = F.scaled_dot_product_attention(
        q_in, k_in, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _largest_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


def _sdpa_batch_first(q, k, v, causal: bool = False):
    """The local attention DistributedAttention calls: [batch, seq, heads, dim] in and out."""
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def _sdpa_seq_first(q, k, v, causal: bool = False):
    """The same for [seq, batch, heads, dim]."""
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.permute(2, 0, 1, 3)


def _rotary_tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as [seq, 1, 1, dim] (sequence first, as DeepSpeed takes them)."""
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), 0.5 ** torch.arange(dim // 2))
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


def _ulysses_case(causal: bool, batch_dim_idx: int, kv_heads: int, rotary: bool) -> float:
    size, rank = comm.get_world_size(), comm.get_rank()
    q, k, v, grad_out = _whole(batch=2, heads=4, kv_heads=kv_heads, seq=4 * size, dim=4)
    cos, sin = _rotary_tables(4 * size, 4)

    def rotate_sdpa_layout(t: torch.Tensor) -> torch.Tensor:
        half_a, half_b = t.chunk(2, dim=-1)
        table = (cos[:, 0, 0], sin[:, 0, 0])
        return t * table[0] + torch.cat((-half_b, half_a), dim=-1) * table[1]

    want = _reference(q, k, v, grad_out, causal, rotate_sdpa_layout if rotary else None)
    # To the module's layout ([b, s, h, d] or [s, b, h, d]), then this rank's contiguous piece.
    order = (0, 2, 1, 3) if batch_dim_idx == 0 else (2, 0, 1, 3)
    to_layout = lambda t: t.permute(order)  # noqa: E731
    seq_dim = 1 - batch_dim_idx
    pieces = [to_layout(t).chunk(size, seq_dim)[rank] for t in (q, k, v, grad_out)]
    q_l, k_l, v_l = (p.clone().requires_grad_() for p in pieces[:3])
    local = _sdpa_batch_first if batch_dim_idx == 0 else _sdpa_seq_first
    attention = DistributedAttention(local, None)
    out = attention(q_l, k_l, v_l, batch_dim_idx, (cos, sin) if rotary else None, causal=causal)
    out.backward(pieces[3])
    got = [out, q_l.grad, k_l.grad, v_l.grad]
    want = [to_layout(t).chunk(size, seq_dim)[rank] for t in want]
    return _largest_error(got, want)


def _ulysses_padding_mask_case() -> float:
    """A key padding mask over the whole sequence (sample 1's last 3 positions padded), given to
    the local attention: after the all-to-all every rank holds every position, so the mask the
    whole-sequence attention takes applies unchanged."""
    size, rank = comm.get_world_size(), comm.get_rank()
    q, k, v, grad_out = _whole(batch=2, heads=4, kv_heads=4, seq=4 * size, dim=4)
    keep = torch.ones(2, 1, 1, 4 * size, dtype=torch.bool)
    keep[1, ..., -3:] = False
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*refs, attn_mask=keep)
    reference.backward(grad_out)
    want = [reference.detach()] + [t.grad for t in refs]

    def local(q_, k_, v_):
        out = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q_, k_, v_)), attn_mask=keep
        )
        return out.transpose(1, 2)

    pieces = [t.transpose(1, 2).chunk(size, 1)[rank] for t in (q, k, v, grad_out)]
    q_l, k_l, v_l = (piece.clone().requires_grad_() for piece in pieces[:3])
    out = DistributedAttention(local, None)(q_l, k_l, v_l, 0)
    out.backward(pieces[3])
    got = [out, q_l.grad, k_l.grad, v_l.grad]
    return _largest_error(got, [t.transpose(1, 2).chunk(size, 1)[rank] for t in want])


def _ulysses_refusal(heads: int, kv_heads: int) -> str:
    q, k, v, _ = _whole(batch=1, heads=heads, kv_heads=kv_heads, seq=comm.get_world_size(), dim=2)
    attention = DistributedAttention(_sdpa_batch_first, None)
    try:
        attention(*(t.transpose(1, 2) for t in (q, k, v)), 0)
    except ValueError as error:
        return str(error)
    return "accepted"


def _deepspeed_all_to_all() -> list[bool]:
    """DeepSpeed's `_SeqAllToAll` arguments, reached through the `deepspeed` alias."""
    from shardspeed.alias import install

    install()
    from deepspeed.sequence.layer import DistributedAttention as ds_attention
    from deepspeed.sequence.layer import _SeqAllToAll

    size = comm.get_world_size()
    x = torch.arange(2 * 3 * 2 * size * 5, dtype=torch.float32).view(2, 3, 2 * size, 5)
    x = x + 1000 * comm.get_rank()
    heads_sharded = _SeqAllToAll.apply(None, x, 2, 0, 0)  # [b, s/P, h, d] -> [b, s, h/P, d]
    back = _SeqAllToAll.apply(None, heads_sharded, 0, 2, 0)
    return [
        ds_attention is DistributedAttention,
        torch.equal(heads_sharded, seq_all_to_all(x, 2, 1, None)),
        tuple(heads_sharded.shape) == (2, 3 * size, 2, 5),
        torch.equal(back, x),
    ]


def _ring_case(causal: bool, kv_heads: int, on_pipe_axis: bool) -> tuple[float, int]:
    """Error against the reference, and the bytes this rank sent in forward."""
    group = None
    # On the pipe axis of a 2 x 2 mesh: a group of 2 whose members are not neighbours ([0, 2]).
    if on_pipe_axis:
        from shardspeed.comm.topology import ProcessTopology, Topology

        group = Topology.from_mesh(ProcessTopology(["pipe", "data"], [2, 2])).pipe_group
    size, rank = comm.get_world_size(group), comm.get_rank(group)
    q, k, v, grad_out = _whole(batch=2, heads=4, kv_heads=kv_heads, seq=4 * size, dim=4)
    want = _reference(q, k, v, grad_out, causal)
    # Causal needs the load-balanced layout; non-causal takes any, so it gets contiguous pieces.
    if causal:
        shard = lambda t: shard_load_balanced(t, 2, rank, size)  # noqa: E731
    else:
        shard = lambda t: t.chunk(size, 2)[rank]  # noqa: E731
    q_l, k_l, v_l = (shard(t).clone().requires_grad_() for t in (q, k, v))
    comm.reset_comm_volume()
    out = ring_attention(q_l, k_l, v_l, group, causal=causal)
    sent = comm.comm_volume().get("send", {}).get("bytes", 0)
    out.backward(shard(grad_out))
    got = [out, q_l.grad, k_l.grad, v_l.grad]
    return _largest_error(got, [shard(t) for t in want]), sent


def _sequence_attention_case(ulysses_degree: int, causal: bool, kv_heads: int) -> float:
    """`sequence_attention` over the world as one sequence group cut by `ulysses_degree`."""
    from shardspeed.comm.topology import Topology

    mesh = Topology.build(None, 1, comm.get_world_size())
    groups = mesh.sequence_split(ulysses_degree)
    size, rank = mesh.sp_world_size, mesh.sp_rank
    q, k, v, grad_out = _whole(batch=2, heads=4, kv_heads=kv_heads, seq=4 * size, dim=4)
    want = _reference(q, k, v, grad_out, causal)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 2, rank, size, groups.ring_size)

    q_l, k_l, v_l = (shard(t).clone().requires_grad_() for t in (q, k, v))
    out = sequence_attention(q_l, k_l, v_l, groups, causal=causal)
    out.backward(shard(grad_out))
    return _largest_error([out, q_l.grad, k_l.grad, v_l.grad], [shard(t) for t in want])


@pytest.mark.parametrize(
    ("ulysses_degree", "causal", "kv_heads"),
    [(2, True, 4), (2, False, 2), (2, True, 1), (4, True, 4), (1, True, 2), (4, True, 2)],
)
def test_sequence_attention_equals_whole_sequence_attention_at_4(
    pool4, ulysses_degree, causal, kv_heads
):
    """Hybrid (Ulysses over 2 ranks, a ring of 2 across), Ulysses alone (degree 4) and the ring
    alone (degree 1), with grouped-query heads: 1 and 2 key/value heads are fewer than the
    Ulysses ranks and are repeated up to them, as DeepSpeed does."""
    errors = pool4.run(_sequence_attention_case, ulysses_degree, causal, kv_heads)
    assert max(errors) < ATOL, errors


def test_sequence_layouts_round_trip():
    whole = torch.arange(32).view(1, 32)
    for ring_size in (1, 2, 4):
        pieces = [shard_sequence(whole, 1, rank, 4, ring_size) for rank in range(4)]
        assert torch.equal(unshard_sequence(pieces, 1, ring_size), whole)
    hybrid = [shard_sequence(whole, 1, rank, 4, 2)[0].tolist() for rank in range(4)]
    # Ring block 0 is chunks 0 and 3 of 4 (positions 0-7 and 24-31), cut over Ulysses ranks 0, 1.
    assert hybrid[0] == list(range(0, 8)) and hybrid[1] == list(range(24, 32))
    assert hybrid[2] == list(range(8, 16)) and hybrid[3] == list(range(16, 24))


@pytest.mark.parametrize(
    ("causal", "batch_dim_idx", "kv_heads", "rotary"),
    [(False, 0, 4, False), (True, 0, 4, False), (True, 1, 4, False), (True, 0, 2, True)],
)
def test_ulysses_equals_whole_sequence_attention_at_2(
    pool2, causal, batch_dim_idx, kv_heads, rotary
):
    errors = pool2.run(_ulysses_case, causal, batch_dim_idx, kv_heads, rotary)
    assert max(errors) < ATOL, errors


@pytest.mark.parametrize(
    ("causal", "batch_dim_idx", "rotary"), [(False, 1, False), (True, 0, True)]
)
def test_ulysses_equals_whole_sequence_attention_at_4(pool4, causal, batch_dim_idx, rotary):
    errors = pool4.run(_ulysses_case, causal, batch_dim_idx, 4, rotary)
    assert max(errors) < ATOL, errors


def test_ulysses_with_a_padding_mask_equals_whole_sequence_attention(pool2):
    errors = pool2.run(_ulysses_padding_mask_case)
    assert max(errors) < ATOL, errors


def test_ulysses_refuses_head_counts_the_group_does_not_divide(pool4):
    gqa, odd = pool4.run(_ulysses_refusal, 4, 2)[0], pool4.run(_ulysses_refusal, 6, 6)[0]
    assert "over 4 ranks" in gqa and "key has 2, value has 2 heads" in gqa, gqa
    assert "query" not in gqa, gqa
    assert "query has 6, key has 6, value has 6 heads (not a multiple of 4)" in odd, odd
    assert "ring_attention" in gqa


def test_deepspeed_sequence_layer_path_and_all_to_all_arguments(pool2):
    assert pool2.run(_deepspeed_all_to_all) == [[True] * 4] * 2


@pytest.mark.parametrize(("causal", "kv_heads"), [(False, 4), (True, 4), (True, 1)])
def test_ring_equals_whole_sequence_attention_at_2(pool2, causal, kv_heads):
    results = pool2.run(_ring_case, causal, kv_heads, False)
    assert max(error for error, _ in results) < ATOL, results


@pytest.mark.parametrize(("causal", "kv_heads"), [(False, 2), (True, 4), (True, 2)])
def test_ring_equals_whole_sequence_attention_at_4(pool4, causal, kv_heads):
    """kv_heads=2 at 4 ranks is the grouped-query case Ulysses refuses."""
    results = pool4.run(_ring_case, causal, kv_heads, False)
    assert max(error for error, _ in results) < ATOL, results
    # Forward sends each rank's key/value block on P-1 hops: 3 x (k and v: 2 x 2x2x4x4 fp32).
    assert {sent for _, sent in results} == {3 * 2 * 2 * kv_heads * 4 * 4 * 4}


def test_ring_over_a_group_of_non_neighbouring_ranks(pool4):
    results = pool4.run(_ring_case, True, 2, True)
    assert max(error for error, _ in results) < ATOL, results


def test_load_balanced_shards_round_trip():
    whole = torch.arange(24).view(1, 24)
    shards = [shard_load_balanced(whole, 1, rank, 3) for rank in range(3)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert shards[2].tolist() == [[8, 9, 10, 11, 12, 13, 14, 15]]
    assert torch.equal(unshard_load_balanced(shards, 1), whole)
    with pytest.raises(ValueError, match="length 24 is not a multiple of 16"):
        shard_load_balanced(whole, 1, 0, 8)
