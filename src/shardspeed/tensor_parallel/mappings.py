"""The collectives of tensor parallelism, each as a tiny autograd Function: what one direction does,
the other undoes, so a layer written with them is autograd-correct by construction.

Two kinds of split:

- the tensor region: the last dim (features) is split over the tensor-parallel group
  (`scatter_to_tensor_region` / `gather_from_tensor_region`), or every rank holds a partial sum
  of the whole (`reduce_from_tensor_region`), or a whole copy whose gradient is partial
  (`copy_to_tensor_region`);
- the sequence region (sequence parallelism): tokens are split along dim -2, the dim before the
  features, that is the sequence of Hugging Face's [batch, seq, hidden] activations. Only
  position-wise work (norms, dropout, residual adds) runs on these shards.

And the rows region: the tokens of a flattened [tokens, features] activation that every rank
holds alike, shared out unevenly where they do not divide (`scatter_to_row_region` /
`gather_from_row_region`), so each rank does its share of work that is per token, such as
experts, without the sizes dividing.

Every function takes the tensor-parallel `group` and is the identity when the group has one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import ReduceOp, all_gather_into_tensor, all_reduce, reduce_scatter_tensor

SEQUENCE_DIM = -2  # tokens: dim 1 of [batch, seq, hidden]


def world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


# -- the three primitives, along any dim --------------------------------------------------------


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's equal part of `x` along `dim`."""
    parts = world_size(group)
    if x.shape[dim] % parts:
        raise ValueError(
            f"cannot split dim {dim} of a {tuple(x.shape)} tensor over {parts} tensor-parallel ranks"
        )
    size = x.shape[dim] // parts
    return x.narrow(dim, rank(group) * size, size).contiguous()


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    # The flat collective concatenates along dim 0, so move `dim` there and back.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world_size(group) * moved.shape[0], *moved.shape[1:]))
    all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum over ranks of `x`, of which this rank keeps its part along `dim`."""
    parts = world_size(group)
    if x.shape[dim] % parts:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of a {tuple(x.shape)} tensor over {parts} ranks"
        )
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // parts, *moved.shape[1:]))
    reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def _row_share(total: int, parts: int, here: int) -> tuple[int, int]:
    """Rank `here`'s first row and row count of `total` rows shared out over `parts` ranks as
    `torch.tensor_split` does (the first `total % parts` ranks take one more)."""
    size, extra = divmod(total, parts)
    return here * size + min(here, extra), size + (here < extra)


def _gather_rows(x: torch.Tensor, total: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's share of `total` rows (dim 0), joined in rank order: each share padded to
    the largest for the flat collective, then trimmed."""
    parts = world_size(group)
    longest = -(-total // parts)
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((parts * longest, *x.shape[1:]))
    all_gather_into_tensor(out, x.contiguous(), group=group)
    if total % parts == 0:
        return out
    counts = [_row_share(total, parts, r)[1] for r in range(parts)]
    return torch.cat([out[r * longest : r * longest + n] for r, n in enumerate(counts)])


def _sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce into a tensor autograd may have saved
    all_reduce(x, group=group)
    return x


# -- the tensor region (last dim) ---------------------------------------------------------------


class _CopyToTensorRegion(torch.autograd.Function):
    """Forward: the replicated input, as is. Backward: each rank's gradient covers only its
    columns' use of the input, so the whole gradient is their sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sum(grad, ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """Forward: the sum of the ranks' partial results. Backward: every rank's part contributed to
    the sum one to one, so each gets the whole gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorRegion(torch.autograd.Function):
    """Forward: this rank's slice of the last dim. Backward: the slices' gradients joined."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, -1, ctx.group), None


class _GatherFromTensorRegion(torch.autograd.Function):
    """Forward: the ranks' slices joined along the last dim. Backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, -1, ctx.group), None


# -- the sequence region (dim -2) ---------------------------------------------------------------


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Forward: this rank's tokens. Backward: the shards' gradients joined (whole on every rank,
    as the replicated input needs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, SEQUENCE_DIM, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all tokens. Backward, when the gathered tensor fed tensor-parallel layers
    (`partial_grad`): each rank's gradient is partial, so sum them and keep this rank's tokens;
    when it fed replicated work: the gradient is whole everywhere, so keep this rank's tokens."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, group: dist.ProcessGroup | None, partial_grad: bool
    ) -> torch.Tensor:
        ctx.group, ctx.partial_grad = group, partial_grad
        return _gather(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.partial_grad:
            return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None, None
        return _split(grad, SEQUENCE_DIM, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Forward: the sum of the ranks' partial results, this rank's tokens of it. Backward: the
    tokens' gradients joined (each rank's partial result fed every token)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, SEQUENCE_DIM, ctx.group), None


# -- the rows region (dim 0, uneven) ------------------------------------------------------------


class _ScatterToRowRegion(torch.autograd.Function):
    """Forward: this rank's share of the rows. Backward: the shares' gradients joined (whole
    on every rank, as the replicated input needs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group, ctx.total = group, x.shape[0]
        return x[row_share(x.shape[0], group)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_rows(grad, ctx.total, ctx.group), None


class _GatherFromRowRegion(torch.autograd.Function):
    """Forward: all `total` rows. Backward: the result fed replicated work, so the gradient is
    whole everywhere: keep this rank's share."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, total: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_rows(x, total, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[row_share(grad.shape[0], ctx.group)], None, None


# -- the public functions -----------------------------------------------------------------------


def copy_to_tensor_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward, all-reduce backward: the input of column-parallel layers."""
    return x if world_size(group) == 1 else _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce forward, identity backward: the output of row-parallel layers."""
    return x if world_size(group) == 1 else _ReduceFromTensorRegion.apply(x, group)


def scatter_to_tensor_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward, all-gather backward."""
    return x if world_size(group) == 1 else _ScatterToTensorRegion.apply(x, group)


def gather_from_tensor_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim forward, keep this rank's slice backward."""
    return x if world_size(group) == 1 else _GatherFromTensorRegion.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's tokens (dim -2) forward, all-gather backward: entering a
    sequence-parallel stretch from replicated work."""
    return x if world_size(group) == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, partial_grad: bool = True
) -> torch.Tensor:
    """All-gather the tokens (dim -2) forward. Backward: reduce-scatter when the result feeds
    tensor-parallel layers (`partial_grad`, the input of a column-parallel layer), keep this
    rank's tokens when it feeds replicated work (leaving a sequence-parallel stretch)."""
    if world_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, partial_grad)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Reduce-scatter the tokens (dim -2) forward, all-gather backward: the output of
    row-parallel layers under sequence parallelism."""
    return x if world_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def scatter_to_row_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's share of the rows (dim 0; shares differ by at most one row) forward,
    all-gather backward."""
    return x if world_size(group) == 1 else _ScatterToRowRegion.apply(x, group)


def row_share(total: int, group: dist.ProcessGroup | None) -> slice:
    """The rows of `total` that `scatter_to_row_region` keeps on this rank."""
    first, count = _row_share(total, world_size(group), rank(group))
    return slice(first, first + count)


def gather_from_row_region(
    x: torch.Tensor, total: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """All-gather every rank's share of `total` rows forward (for replicated work after it),
    keep this rank's share backward."""
    return x if world_size(group) == 1 else _GatherFromRowRegion.apply(x, total, group)


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The element-wise maximum over ranks (no gradient: used for numerical shifts)."""
    x = x.detach().clone()
    if world_size(group) > 1:
        all_reduce(x, op=ReduceOp.MAX, group=group)
    return x


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The element-wise sum over ranks, outside autograd."""
    return _sum(x.detach(), group) if world_size(group) > 1 else x.detach().clone()
