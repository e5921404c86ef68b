"""Tiled compute over the sequence (runtime/sequence_parallel/tiled.py): TiledMLP,
TiledFusedLogitsLoss and sequence_tiled_compute equal the untiled computation, forward and
gradients of the input and the parameters, and keep fewer activations alive.

Tolerance: fp32, atol 1e-5 on unit-scale tensors. Tiling changes only which tokens share a
matmul and the order in which the chunks' parameter gradients are summed (measured differences
near 1e-7). Sequence lengths are chosen so that the shards do not divide them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref

import torch
import torch.nn.functional as F

from shardspeed.runtime.sequence_parallel.tiled import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

ATOL = 1e-5
HIDDEN, INTER, VOCAB = 8, 32, 64


class GatedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_forward(module: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))


class SavedActivationPeak:
    """The most bytes of saved activations (autograd's saved tensors, parameters excluded) alive at
    once, over a forward and backward run inside it."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> object:
        box = _Box(tensor)
        if not isinstance(tensor, torch.nn.Parameter):
            size = tensor.numel() * tensor.element_size()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(box, self._release, size)
        return box

    def _release(self, size: int) -> None:
        self.live -= size

    def __enter__(self) -> SavedActivationPeak:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda box: box.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Box:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in module.parameters())]


def _assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def _mlp_case(batch: int, seq: int, shards: int, tiled: bool) -> tuple[torch.Tensor, list, int]:
    torch.manual_seed(0)
    module = GatedMLP()
    x = torch.randn(batch, seq, HIDDEN, requires_grad=True)
    grad_out = torch.randn(batch, seq, HIDDEN)
    with SavedActivationPeak() as peak:
        out = TiledMLP.apply(mlp_forward, module, x, shards) if tiled else module(x)
        # A factor on the output gradient (a loss scale) must reach the parameters too.
        out.backward(3.0 * grad_out)
    return out.detach(), _grads(module, x), peak.peak


def test_tiled_mlp_equals_untiled_and_saves_one_chunk() -> None:
    for batch, seq, shards in [(1, 37, 4), (2, 37, 6), (2, 5, 8)]:
        out, grads, untiled_peak = _mlp_case(batch, seq, shards, tiled=False)
        tiled_out, tiled_grads, tiled_peak = _mlp_case(batch, seq, shards, tiled=True)
        torch.testing.assert_close(tiled_out, out, atol=ATOL, rtol=0)
        _assert_close(tiled_grads, grads)
    # The untiled MLP keeps x and its [seq, INTER] activations (150528 bytes at seq 256); tiled
    # keeps x, plus one chunk's activations while the backward re-runs that chunk: measured
    # 1/3.3 of it at 4 shards and 1/7.4 at 16 (x alone is 1/18).
    _, _, untiled_peak = _mlp_case(1, 256, 4, tiled=False)
    _, _, tiled_peak = _mlp_case(1, 256, 4, tiled=True)
    assert tiled_peak * 3 < untiled_peak, (tiled_peak, untiled_peak)
    _, _, tiled_peak_16 = _mlp_case(1, 256, 16, tiled=True)
    assert tiled_peak_16 * 6 < untiled_peak, (tiled_peak_16, untiled_peak)


def test_tiled_mlp_compute_params_for_a_plain_function() -> None:
    """`self` need not be a module: the weights listed in compute_params get their gradients."""
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN, requires_grad=True)
    x = torch.randn(2, 11, HIDDEN, requires_grad=True)
    torch.tanh(x @ weight).sum().backward()
    expected = [x.grad.clone(), weight.grad.clone()]
    x.grad = weight.grad = None
    out = TiledMLP.apply(lambda _, chunk: torch.tanh(chunk @ weight), None, x, 3, [weight])
    out.sum().backward()
    _assert_close([x.grad, weight.grad], expected)


def _head_and_batch(seq: int):
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    x = torch.randn(2, seq, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, seq))
    labels[0, :5] = -100
    return head, x, labels


def _summed_loss(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(x).float()
    return F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1), reduction="sum")


def test_tiled_fused_logits_loss_sum_equals_whole_mean_loss() -> None:
    """'sum' of per-chunk summed losses over the labelled tokens is the whole batch's mean loss."""
    minimum_saving = {4: 2.5, 7: 3.5}
    for shards in minimum_saving:
        head, x, labels = _head_and_batch(37)
        tokens = (labels != -100).sum()
        with SavedActivationPeak() as untiled:
            loss = _summed_loss(head, x, labels) / tokens
            loss.backward()
        expected = [loss.detach(), *_grads(head, x)]
        head, x, labels = _head_and_batch(37)
        with SavedActivationPeak() as tiled:
            tiled_loss = (
                TiledFusedLogitsLoss.apply(
                    _summed_loss, head, x, labels, None, shards, [head.weight], "sum"
                )
                / tokens
            )
            tiled_loss.backward()
        _assert_close([tiled_loss.detach(), *_grads(head, x)], expected)
        # Whole: 74 tokens' logits (and their log-softmax); tiled: x, the labels and one chunk's
        # logits at a time. Measured 1/2.8 of the whole at 4 shards, 1/3.9 at 7.
        assert tiled.peak * minimum_saving[shards] < untiled.peak, (tiled.peak, untiled.peak)


def test_tiled_fused_logits_loss_mean_with_mask() -> None:
    """'mean' is the mean of the chunks' losses; a mask is cut with x and y and passed to fn."""
    head, x, labels = _head_and_batch(13)
    mask = torch.rand(2, 13) > 0.3

    def masked_loss(head, x, y, mask):
        per_token = F.cross_entropy(head(x), y, reduction="none", ignore_index=-100)
        return (per_token * mask).sum()

    flat = [x.reshape(-1, HIDDEN), labels.reshape(-1), mask.reshape(-1)]
    chunks = zip(*(torch.chunk(t, 3) for t in flat))
    expected_loss = torch.stack([masked_loss(head, *c) for c in chunks]).mean()
    expected_loss.backward()
    expected = [expected_loss.detach(), *_grads(head, x)]
    head, x, labels = _head_and_batch(13)
    loss = TiledFusedLogitsLoss.apply(masked_loss, head, x, labels, mask, 3, [], "mean")
    loss.backward()
    _assert_close([loss.detach(), *_grads(head, x)], expected)


def test_sequence_tiled_compute_equals_untiled() -> None:
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN, requires_grad=True)
    x = torch.randn(2, 23, HIDDEN, requires_grad=True)
    bias = torch.randn(HIDDEN, requires_grad=True)

    def fn(hidden_states, bias, scale):
        return scale * torch.tanh(hidden_states @ weight + bias)

    for dim, reduction in [(1, None), (1, "mean"), (1, "sum"), (0, "mean")]:
        for t in (x, weight, bias):
            t.grad = None
        if dim == 0:
            chunks = torch.chunk(x, 5, 1)
            expected_out = torch.stack([fn(c, bias, 2.0).sum() for c in chunks]).mean()
        else:
            expected_out = fn(x, bias, 2.0)
            expected_out = {None: expected_out, "mean": expected_out.mean()}.get(
                reduction, expected_out.sum()
            )
        expected_out.backward(torch.ones_like(expected_out))
        expected = [expected_out.detach(), x.grad, weight.grad, bias.grad]
        for t in (x, weight, bias):
            t.grad = None
        per_chunk = (lambda **kw: fn(**kw).sum()) if dim == 0 else fn
        out = sequence_tiled_compute(
            per_chunk,
            23,
            5,
            {"hidden_states": x},
            {"bias": bias, "scale": 2.0},
            "hidden_states",
            [weight],
            output_unshard_dimension=dim,
            output_reduction=reduction,
        )
        out.backward(torch.ones_like(out))
        _assert_close([out.detach(), x.grad, weight.grad, bias.grad], expected)


def test_deepspeed_import_path() -> None:
    """Under the `deepspeed` alias, DeepSpeed's ulysses_sp names are these classes."""
    script = (
        "from shardspeed.alias import install\n"
        "install()\n"
        "from deepspeed.runtime.sequence_parallel import ulysses_sp as ds\n"
        "from shardspeed.runtime.sequence_parallel import tiled\n"
        "assert ds.TiledMLP is tiled.TiledMLP\n"
        "assert ds.TiledFusedLogitsLoss is tiled.TiledFusedLogitsLoss\n"
        "assert ds.SequenceTiledCompute is tiled.SequenceTiledCompute\n"
        "assert ds.sequence_tiled_compute is tiled.sequence_tiled_compute\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
