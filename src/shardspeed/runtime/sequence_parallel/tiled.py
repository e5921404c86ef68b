"""Tiled compute over the sequence (the memory half of DeepSpeed's ALST, Arctic Long Sequence
Training): an MLP, a head-plus-loss, or any per-token function run over the sequence in chunks.

The forward runs each chunk without autograd and keeps only the inputs. The backward re-runs one
chunk at a time with autograd and takes that chunk's gradients before building the next chunk's
graph, so the activations alive at any moment are one chunk's, not the whole sequence's. The price
is one extra forward of the tiled function per step.

The functions may only mix positions inside a chunk (per-token MLPs, a vocabulary head and its
loss): chunks are computed independently.

Unlike DeepSpeed, the parameters' gradients do not go into `.grad` chunk by chunk from inside the
backward. The parameters (`compute_params`, and those of `self` when it is a module) are inputs of
the autograd function, and their gradients, summed over the chunks, flow out of it like any other
gradient: each parameter's gradient hook fires once per backward, as the engine's gradient
reduction expects, and a loss scale or any other factor on the output gradient reaches them. The
cost is one parameter-sized buffer per parameter during the backward. A tensor that `fn` closes
over and that is not listed gets no gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_REDUCTIONS = ("mean", "sum")


def _parameters(module: Any, compute_params: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    """The trainable tensors a tiled function reads: `compute_params` and the module's own
    parameters, each once."""
    candidates = list(compute_params or [])
    if isinstance(module, torch.nn.Module):
        candidates += list(module.parameters())
    unique = {id(p): p for p in candidates if p.requires_grad}
    return list(unique.values())


def _run_tiles(
    run: Callable[..., torch.Tensor],
    sharded: Sequence[torch.Tensor],
    dim: int,
    shards: int,
    whole: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Each chunk's output, computed without autograd. Chunks follow `torch.chunk`: equal lengths
    of ceil(len / shards), the last one shorter (and fewer than `shards` of them when the lengths
    come out so)."""
    pieces = [torch.chunk(t, shards, dim) for t in sharded]
    with torch.no_grad():
        return [run(*chunk, *whole) for chunk in zip(*pieces)]


def _backward_tiles(
    run: Callable[..., torch.Tensor],
    sharded: Sequence[torch.Tensor],
    dim: int,
    shards: int,
    whole: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    needs_grad: Sequence[bool],
    output_grads: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Gradients of `sharded + whole + params` (`whole` may hold non-tensors, never differentiated) (in that order; None where `needs_grad` is false):
    each chunk is re-run with autograd and differentiated against `output_grads[i]` before the
    next one is built. Sharded inputs get their chunks' gradients in place; whole inputs and
    parameters get the sum over chunks."""
    n_sharded = len(sharded)
    whole = [
        w.detach().requires_grad_(need) if torch.is_tensor(w) else w
        for w, need in zip(whole, needs_grad[n_sharded:])
    ]
    sharded_grads = [torch.zeros_like(t) if need else None for t, need in zip(sharded, needs_grad)]
    summed: list[torch.Tensor | None] = [None] * (len(whole) + len(params))
    pieces = [torch.chunk(t.detach(), shards, dim) for t in sharded]
    offset = 0
    for chunk, output_grad in zip(zip(*pieces), output_grads):
        inputs = [c.detach().requires_grad_(need) for c, need in zip(chunk, needs_grad)]
        with torch.enable_grad():
            output = run(*inputs, *whole)
        candidates = [*inputs, *whole, *params]
        wanted = [i for i, need in enumerate(needs_grad) if need]
        if wanted and output.requires_grad:
            grads = torch.autograd.grad(
                output, [candidates[i] for i in wanted], output_grad, allow_unused=True
            )
            for i, grad in zip(wanted, grads):
                if grad is None:
                    continue
                if i < n_sharded:
                    sharded_grads[i].narrow(dim, offset, chunk[0].shape[dim]).copy_(grad)
                elif summed[i - n_sharded] is None:
                    summed[i - n_sharded] = grad
                else:
                    summed[i - n_sharded] += grad
        offset += chunk[0].shape[dim]
    return [*sharded_grads, *summed]


class TiledMLP(torch.autograd.Function):
    """DeepSpeed's tiled MLP: `TiledMLP.apply(fn, self, x, shards, compute_params=None)` returns
    `fn(self, x)` computed over `shards` chunks of the sequence dim (-2, so `x` is
    `[batch, seq, hidden]` or `[tokens, hidden]`), saving only `x` for the backward. `self` is
    the MLP module (its parameters get gradients), `compute_params` any further weights `fn`
    uses. See the module docstring for what it saves and costs."""

    @classmethod
    def apply(  # type: ignore[override]  # DeepSpeed's signature; parameters appended for autograd
        cls,
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        self: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(
                f"TiledMLP tiles dim -2 of x ([batch, seq, hidden] or [tokens, hidden]); "
                f"got x of shape {tuple(x.shape)}"
            )
        return super().apply(fn, self, x, shards, *_parameters(self, compute_params))

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: torch.Tensor, shards: int, *params):
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.save_for_backward(x, *params)
        outputs = _run_tiles(lambda chunk: fn(module, chunk), [x], -2, shards)
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        x, *params = ctx.saved_tensors
        grads = _backward_tiles(
            lambda chunk: ctx.fn(ctx.module, chunk),
            [x],
            -2,
            ctx.shards,
            (),
            params,
            (ctx.needs_input_grad[2], *ctx.needs_input_grad[4:]),
            torch.chunk(grad_output, ctx.shards, -2),
        )
        return (None, None, grads[0], None, *grads[1:])


class TiledFusedLogitsLoss(torch.autograd.Function):
    """DeepSpeed's fused head and loss: `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards,
    compute_params, output_reduction)`. `fn(self, x_chunk, y_chunk[, mask_chunk])` returns one
    chunk's scalar loss (typically the head projection, then cross-entropy), so the logits exist
    for one chunk at a time, in the forward and again in the backward. `x` and `y` are
    `[batch, seq, ...]`, `mask` None or `[batch, seq]` (passed to `fn` only when given); the
    batch and sequence dims are flattened and cut into `shards` chunks of tokens.

    `output_reduction` "mean" returns the mean of the chunks' losses, "sum" their sum. When the
    chunks hold different numbers of counted tokens (a last shorter chunk, masked or ignored
    labels), have `fn` return a sum and divide the "sum" by the token count for a true mean.
    """

    @classmethod
    def apply(  # type: ignore[override]  # DeepSpeed's signature; parameters appended for autograd
        cls,
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        if output_reduction not in _REDUCTIONS:
            raise ValueError(
                f"output_reduction {output_reduction!r} is not supported: use 'mean' or 'sum'"
            )
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"x and y must both be [batch, seq, ...] with the same batch and seq; got x "
                f"{tuple(x.shape)} and y {tuple(y.shape)}"
            )
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(
                f"mask must be [batch, seq] = {tuple(x.shape[:2])}; got {tuple(mask.shape)}"
            )
        params = _parameters(self, compute_params)
        return super().apply(fn, self, shards, output_reduction, x, y, mask, *params)

    @staticmethod
    def forward(ctx: Any, fn, module, shards, output_reduction, x, y, mask, *params):
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.output_reduction, ctx.has_mask = output_reduction, mask is not None
        ctx.run = lambda *chunk: fn(module, *chunk)
        ctx.save_for_backward(x, y, *([mask] if mask is not None else []), *params)
        losses = torch.stack(_run_tiles(ctx.run, _tokens(x, y, mask), 0, shards))
        ctx.chunk_count = len(losses)
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        x, y, *rest = ctx.saved_tensors
        mask = rest.pop(0) if ctx.has_mask else None
        chunk_grad = (
            grad_output / ctx.chunk_count if ctx.output_reduction == "mean" else grad_output
        )
        needs = ctx.needs_input_grad
        grads = _backward_tiles(
            ctx.run,
            _tokens(x, y, mask),
            0,
            ctx.shards,
            (),
            rest,
            (needs[4], needs[5], *([False] if mask is not None else []), *needs[7:]),
            [chunk_grad] * ctx.chunk_count,
        )
        x_grad, y_grad = (g if g is None else g.view(t.shape) for g, t in zip(grads, (x, y)))
        return (None, None, None, None, x_grad, y_grad, None, *grads[2 + ctx.has_mask :])


def _tokens(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """`x`, `y` (and `mask`) with batch and sequence flattened into one token dim."""
    flat = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]
    return flat if mask is None else [*flat, mask.reshape(-1)]


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """DeepSpeed's general tiled compute: `fn(**kwargs_to_shard chunks, **kwargs_to_pass)` over
    `shards` chunks of dim 1 (every `kwargs_to_shard` value is `[batch, seqlen, ...]`); the chunks'
    outputs are concatenated on `output_unshard_dimension` (0 stacks one output per chunk, the
    loss case), then reduced by `output_reduction` (None, "mean" over all elements, or "sum").
    Every tensor argument that requires grad gets its gradient, and so do `compute_params`;
    `grad_requiring_tensor_key` must name one of the arguments."""
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


class SequenceTiledCompute(torch.autograd.Function):
    """DeepSpeed's autograd function behind `sequence_tiled_compute`, with its `apply` arguments:
    `(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
    output_unshard_dimension, output_reduction, *values)`, the values of `keys_to_shard` then of
    `keys_to_pass`."""

    @classmethod
    def apply(  # type: ignore[override]  # DeepSpeed's signature; parameters appended for autograd
        cls,
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: Sequence[str],
        keys_to_pass: Sequence[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[torch.Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> torch.Tensor:
        if output_reduction is not None and output_reduction not in _REDUCTIONS:
            raise ValueError(
                f"output_reduction {output_reduction!r} is not supported: use None, 'mean' or 'sum'"
            )
        keys = [*keys_to_shard, *keys_to_pass]
        if grad_requiring_tensor_key not in keys:
            raise ValueError(
                f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of the "
                f"arguments {keys}"
            )
        if len(args) != len(keys):
            raise ValueError(f"{len(args)} values given for the {len(keys)} arguments {keys}")
        for key, value in zip(keys_to_shard, args):
            if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != seqlen:
                raise ValueError(
                    f"kwargs_to_shard[{key!r}] must be a [batch, {seqlen}, ...] tensor (seqlen "
                    f"{seqlen}); got {tuple(value.shape) if torch.is_tensor(value) else value!r}"
                )
        output = super().apply(
            fn,
            shards,
            list(keys_to_shard),
            list(keys_to_pass),
            output_unshard_dimension,
            len(args),
            *args,
            *_parameters(None, compute_params),
        )
        if output_reduction is None:
            return output
        return output.mean() if output_reduction == "mean" else output.sum()

    @staticmethod
    def forward(ctx: Any, fn, shards, keys_to_shard, keys_to_pass, output_dim, n_args, *tensors):
        n_sharded = len(keys_to_shard)

        def run(*values: Any) -> torch.Tensor:
            return fn(
                **dict(zip(keys_to_shard, values[:n_sharded])),
                **dict(zip(keys_to_pass, values[n_sharded:])),
            )

        args, params = tensors[:n_args], tensors[n_args:]
        ctx.run, ctx.shards, ctx.output_dim = run, shards, output_dim
        ctx.n_sharded, ctx.n_args = n_sharded, n_args
        ctx.non_tensors = {i: a for i, a in enumerate(args) if not torch.is_tensor(a)}
        ctx.save_for_backward(*(a if torch.is_tensor(a) else None for a in args), *params)
        outputs = _run_tiles(run, args[:n_sharded], 1, shards, args[n_sharded:])
        if output_dim == 0:
            ctx.output_sizes = [1] * len(outputs)
            return torch.stack(outputs)
        ctx.output_sizes = [o.shape[output_dim] for o in outputs]
        return torch.cat(outputs, dim=output_dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        saved = list(ctx.saved_tensors)
        args = [ctx.non_tensors.get(i, saved[i]) for i in range(ctx.n_args)]
        output_grads = torch.split(grad_output, ctx.output_sizes, ctx.output_dim)
        if ctx.output_dim == 0:
            output_grads = [g.squeeze(0) for g in output_grads]
        grads = _backward_tiles(
            ctx.run,
            args[: ctx.n_sharded],
            1,
            ctx.shards,
            args[ctx.n_sharded :],
            saved[ctx.n_args :],
            ctx.needs_input_grad[6:],
            output_grads,
        )
        return (None, None, None, None, None, None, *grads)


def tile_mlps(model: torch.nn.Module, chunk_size: int | None) -> int:
    """Run every `mlp` submodule of `model` (Hugging Face decoder layers name their MLP so) through
    `TiledMLP`, in chunks of `chunk_size` positions (None: as many positions as the hidden size,
    ALST's choice: a chunk's intermediate activations are then about a hidden-size square).
    Returns how many were tiled; an MLP already tiled is left as it is."""
    tiled = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, torch.nn.Module) or "forward" in vars(mlp):
            continue
        mlp.forward = _tiled_forward(mlp, type(mlp).forward, chunk_size)
        tiled += 1
    return tiled


def _tiled_forward(
    mlp: torch.nn.Module, forward: Callable[..., torch.Tensor], chunk_size: int | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def tiled(x: torch.Tensor) -> torch.Tensor:
        shards = -(-x.shape[-2] // (chunk_size or x.shape[-1]))
        return TiledMLP.apply(forward, mlp, x, max(shards, 1))

    return tiled
