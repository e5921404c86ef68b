"""Megatron's tensor-parallel layers: linears split by output (column) or input (row), an embedding
split by vocabulary, and the cross-entropy of vocabulary-split logits.

Each layer can be built from the unsplit module (`from_linear`, `from_embedding`): every rank
keeps its slice of the loaded weights, so a model is loaded whole and then split, and a split
model computes what the whole one does.

Split parameters carry `tensor_model_parallel = True`, `partition_dim` (the dim of the whole
tensor that is cut) and `partition_stride` (k for a fused weight of k equal parts, such as GPT-2's
q|k|v: each rank holds its 1/t of every part, concatenated). Parameters that stay whole but get
only a partial gradient on each rank (those working on sequence shards: a row-parallel bias under
sequence parallelism, the layer norms between such layers) carry `sequence_parallel = True`: their
gradients must be summed over the tensor group before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .mappings import (
    all_reduce_max,
    all_reduce_sum,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    rank,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
    world_size,
)

Group = dist.ProcessGroup | None


def piece(whole: torch.Tensor, dim: int, group: Group, stride: int = 1) -> torch.Tensor:
    """This rank's piece of `whole`: its 1/t along `dim` of each of `stride` equal parts."""
    size = world_size(group)
    if whole.shape[dim] % (size * stride):
        fused = f" ({stride} fused parts)" if stride > 1 else ""
        raise ValueError(
            f"dim {dim} of a {tuple(whole.shape)} weight{fused} does not split into {size} equal "
            "tensor-parallel pieces"
        )
    parts = whole.detach().chunk(stride, dim)
    return torch.cat([p.chunk(size, dim)[rank(group)] for p in parts], dim).clone()


def whole(piece_: torch.Tensor, dim: int, group: Group, stride: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's `piece` (collective over `group`): the inverse of
    `piece`, fused parts (`stride`) put back in order."""
    size = world_size(group)
    if size == 1:
        return piece_
    gathered = [torch.empty_like(piece_) for _ in range(size)]
    dist.all_gather(gathered, piece_.contiguous(), group=group)
    blocks = [g.chunk(stride, dim) for g in gathered]
    return torch.cat([b[j] for j in range(stride) for b in blocks], dim)


def _split_parameter(
    whole: torch.Tensor, dim: int, group: Group, stride: int = 1, requires_grad: bool = True
) -> nn.Parameter:
    param = nn.Parameter(piece(whole, dim, group, stride), requires_grad=requires_grad)
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    return param


def _whole_parameter(whole: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:
    return nn.Parameter(whole.detach().clone(), requires_grad=requires_grad)


def _weight_of(module: nn.Module) -> tuple[torch.Tensor, bool]:
    """(weight, transposed): nn.Linear keeps [out, in]; Hugging Face's Conv1D keeps [in, out]
    (`nf` outputs, `nx` inputs), and the split layer keeps that layout so names and shapes stay
    those of the model's checkpoints."""
    if isinstance(module, nn.Linear):
        return module.weight, False
    if hasattr(module, "nf") and hasattr(module, "nx"):
        return module.weight, True
    raise TypeError(f"{type(module).__name__} is not a linear layer (nn.Linear or Conv1D)")


def enter_tensor_region(
    x: torch.Tensor, group: Group, sequence_parallel: bool = False
) -> torch.Tensor:
    """Make a replicated input (or, with `sequence_parallel`, a sequence shard) the input of
    column-parallel layers. Done once for several layers that read the same input (q, k and v)
    when they are built with `input_in_region=True`."""
    if sequence_parallel:
        return gather_from_sequence_region(x, group)
    return copy_to_tensor_region(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split along its outputs: each rank computes its slice of y's features.

    The input is whole on every rank (or a sequence shard, all-gathered first, with
    `sequence_parallel`; or already entered by the caller, `input_in_region`). `gather_output`
    joins the slices; otherwise the output stays split, the input of a row-parallel layer.
    `stride` k: the weight is k fused equal parts, split each (the output then holds the rank's
    slice of every part, in order)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        *,
        stride: int = 1,
        input_in_region: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if gather_output and stride > 1:
            raise ValueError(
                "gather_output of a fused (stride > 1) weight would interleave its parts"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.input_in_region = sequence_parallel, input_in_region
        self.transposed = False
        # Drawn whole, then sliced: the same seed gives the same model at any tensor-parallel size.
        self._load(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype), stride)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Group, **options) -> ColumnParallelLinear:
        """The layer holding this rank's slice of `linear`'s weights (nn.Linear or Conv1D)."""
        weight, transposed = _weight_of(linear)
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        bias = getattr(linear, "bias", None) is not None
        layer = cls(in_features, out_features, group, bias, device="meta", **options)
        layer._load(linear, layer.weight.partition_stride)
        return layer

    def _load(self, linear: nn.Module, stride: int) -> None:
        weight, self.transposed = _weight_of(linear)
        out_dim = 1 if self.transposed else 0
        self.weight = _split_parameter(weight, out_dim, self.group, stride, weight.requires_grad)
        bias = getattr(linear, "bias", None)
        self.bias = None
        if bias is not None:
            self.bias = _split_parameter(bias, 0, self.group, stride, bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_tensor_region(x, self.group, self.sequence_parallel)
        weight = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, weight, self.bias)
        return gather_from_tensor_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this rank: {self.weight.shape[1 if self.transposed else 0]}), "
            f"stride={self.weight.partition_stride}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split along its inputs: each rank's product with its slice of x's
    features is a partial sum, all-reduced (or reduce-scattered into sequence shards with
    `sequence_parallel`); the bias is added once, after. The input arrives split
    (`input_is_parallel`, the output of a column-parallel layer) or whole and is sliced here."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel row layer needs its input split by features")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.transposed = False
        self._load(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Group, **options) -> RowParallelLinear:
        """The layer holding this rank's slice of `linear`'s weights (nn.Linear or Conv1D)."""
        weight, transposed = _weight_of(linear)
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        bias = getattr(linear, "bias", None) is not None
        layer = cls(in_features, out_features, group, bias, device="meta", **options)
        layer._load(linear)
        return layer

    def _load(self, linear: nn.Module) -> None:
        weight, self.transposed = _weight_of(linear)
        in_dim = 0 if self.transposed else 1
        self.weight = _split_parameter(weight, in_dim, self.group, 1, weight.requires_grad)
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else _whole_parameter(bias, bias.requires_grad)
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True  # each rank adds it to its own tokens only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.group)
        weight = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group)
        else:
            y = reduce_from_tensor_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} "
            f"(this rank: {self.weight.shape[0 if self.transposed else 1]}), "
            f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split in contiguous ranges: each rank looks up
    the ids in its range, zeros for the rest, and the all-reduce (or, with `sequence_parallel`,
    the reduce-scatter into sequence shards) assembles the whole. Its weight is also the
    column-parallel weight of a tied output layer: `vocab_parallel_cross_entropy` takes those
    logits split."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Group,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        whole = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        self._load(whole)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: Group, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        """The embedding holding this rank's rows of `embedding`."""
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            group,
            embedding.padding_idx,
            sequence_parallel,
            device="meta",
        )
        layer._load(embedding)
        return layer

    def _load(self, embedding: nn.Embedding) -> None:
        weight = embedding.weight
        self.weight = _split_parameter(weight, 0, self.group, 1, weight.requires_grad)
        rows = self.weight.shape[0]
        self.start = rank(self.group) * rows
        self.end = self.start + rows
        padding = embedding.padding_idx
        self.padding_idx = padding
        self.local_padding_idx = (
            padding - self.start
            if padding is not None and self.start <= padding < self.end
            else None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group)
        return reduce_from_tensor_region(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (this rank: ids {self.start} to "
            f"{self.end - 1}), sequence_parallel={self.sequence_parallel}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy over logits split by vocabulary: two small all-reduces (the max, then
    the sum of exponentials together with the target's logit, which only its owner holds) instead
    of gathering [tokens, vocab] logits."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int
    ) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()
        shifted = logits - all_reduce_max(logits.max(dim=-1).values, group).unsqueeze(-1)
        rows = logits.shape[-1]
        start = rank(group) * rows
        elsewhere = (target < start) | (target >= start + rows)
        local = (target - start).masked_fill(elsewhere, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
        exp = shifted.exp()
        picked, total = all_reduce_sum(torch.stack([picked, exp.sum(dim=-1)]), group)
        ignored = target == ignore_index
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, elsewhere | ignored, ignored)
        return (total.log() - picked).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, not_here, ignored = ctx.saved_tensors
        # d loss / d logit = softmax - one_hot(target); the one lies in its owner's slice only.
        one = (~not_here).to(softmax.dtype).unsqueeze(-1)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -one)
        grad_logits = grad_logits * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad_logits.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy (float32, target's shape) of logits split by vocabulary across
    `group` (this rank's contiguous range, as `VocabParallelEmbedding` splits it), without
    gathering them. Tokens whose target is `ignore_index` get 0 and no gradient; the caller takes
    the mean (over the tokens not ignored, for `F.cross_entropy`'s)."""
    if world_size(group) == 1:
        flat = F.cross_entropy(
            logits.float().flatten(0, -2),
            target.flatten(),
            ignore_index=ignore_index,
            reduction="none",
        )
        return flat.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)


def mark_sequence_parallel(module: nn.Module) -> None:
    """Mark the parameters of a module that works on sequence shards (a layer norm between
    sequence-parallel layers): each rank's gradient is partial, summed over the tensor group."""
    for param in module.parameters():
        param.sequence_parallel = True


def tensor_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters split over the tensor group (`tensor_model_parallel`)."""
    return [p for p in module.parameters() if getattr(p, "tensor_model_parallel", False)]


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The whole parameters whose gradients are partial on each rank (`sequence_parallel`)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


class GatherReplacedLayerParams:
    """DeepSpeed's `module_inject.layers.GatherReplacedLayerParams(params, module, enabled=True)`:
    inside the block the tensor-parallel parameters among `params` (those split by automatic
    tensor parallelism or the parallel layers: `tensor_model_parallel`) are whole on every rank
    of the tensor-parallel group; on leaving, each rank keeps its piece of them again, changes
    made inside included. Collective over that group. `group` (a shardspeed addition) defaults to
    the running job's tensor-parallel group. With no such parameter it does nothing."""

    def __init__(
        self, params: torch.Tensor | Iterable[torch.Tensor], module: nn.Module,
        enabled: bool = True, group: Group = None,
    ) -> None:  # fmt: skip
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.module = module
        self.params = [p for p in params if getattr(p, "tensor_model_parallel", False)]
        self.enabled = enabled and bool(self.params)
        self.group = group
        self._pieces: list[torch.Tensor] = []

    def __enter__(self) -> GatherReplacedLayerParams:
        if not self.enabled:
            return self
        if self.group is None:
            from ..comm import groups

            self.group = groups._get_model_parallel_group()
        for p in self.params:
            self._pieces.append(p.data)  # the piece keeps its storage (a view into flat buffers)
            p.data = whole(p.data, p.partition_dim, self.group, getattr(p, "partition_stride", 1))
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        for p, kept in zip(self.params, self._pieces):
            kept.copy_(
                piece(p.data, p.partition_dim, self.group, getattr(p, "partition_stride", 1))
            )
            p.data = kept
        self._pieces = []
