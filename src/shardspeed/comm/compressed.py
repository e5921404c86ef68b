"""1-bit compressed all-reduce with error feedback: the communication of 1-bit Adam and 0/1 Adam.

A rank sends the signs of its tensor (8 per byte) and one scale instead of fp32 values, so each
phase moves 1/32 of the bytes. The rounding error is not dropped: each rank keeps it (the worker
error, the size of the padded tensor; the server error, one chunk) and adds it to the next call's
input, so what one call loses the following calls send. Averaged over many calls the results
approach the true averages even though each single result is coarse.

Two phases, as in DeepSpeed's NCCL backend (arXiv:2102.02888):

1. every rank compresses `tensor + worker_error`, cuts the signs into one chunk per rank and sends
   each chunk to its owner (all-to-all);
2. every owner averages the chunks it received, adds its server error, compresses again and sends
   the result to everyone (all-gather); everyone decompresses the whole tensor.

The scale of each message travels in its last 4 bytes, so each phase is a single collective of
uint8. Both go through the counting wrappers of `shardspeed.comm`, so `comm_volume()` reports them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .comm import all_gather_into_tensor, all_to_all_single, get_world_size

_SCALE_BYTES = 4  # one float32 scale at the end of each message


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of 8 * `world_size`: each rank's chunk is whole bytes of
    signs. This is the size of the worker error; the server error is 1/`world_size` of it."""
    step = 8 * world_size
    return -(-numel // step) * step


def error_buffers(
    numel: int, world_size: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (worker error, server error) for a tensor of `numel` elements over `world_size` ranks.

    Keep one pair per tensor that is all-reduced repeatedly: the errors carry over between calls.
    """
    total = padded_numel(numel, world_size)
    return (
        torch.zeros(total, dtype=torch.float32, device=device),
        torch.zeros(total // world_size, dtype=torch.float32, device=device),
    )


def compressed_allreduce(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Any = None,
) -> torch.Tensor:
    """Average `tensor` over `group` in place through 1-bit messages; returns `tensor`.

    `worker_error` and `server_error` (fp32, from `error_buffers`) are this rank's and are updated.
    Every rank ends with the same result. Nothing is lost between calls: the result plus the mean
    of the ranks' new worker errors plus the gathered new server errors equals the true average of
    the inputs plus the old errors.
    """
    world = get_world_size(group)
    numel = tensor.numel()
    total = padded_numel(numel, world)
    if worker_error.numel() != total or server_error.numel() != total // world:
        raise ValueError(
            f"error buffers of {worker_error.numel()} and {server_error.numel()} elements do not "
            f"fit a tensor of {numel} elements over {world} ranks: make them with "
            "error_buffers(numel, world_size)"
        )
    chunk = total // world
    device = tensor.device

    compensated = torch.zeros(total, dtype=torch.float32, device=device)
    compensated[:numel].copy_(tensor.reshape(-1))
    compensated.add_(worker_error)
    signs, scale = _compress(compensated, worker_error)
    sent = torch.cat([signs.view(world, chunk // 8), _scale_bytes(scale).expand(world, -1)], 1)
    received = torch.empty_like(sent)
    all_to_all_single(received, sent, group=group)

    server = _decompress(received).mean(0)
    server.add_(server_error)
    signs, scale = _compress(server, server_error)
    message = torch.cat([signs, _scale_bytes(scale)[0]])
    gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=device)
    all_gather_into_tensor(gathered, message, group=group)

    result = _decompress(gathered.view(world, -1)).reshape(-1)[:numel]
    tensor.copy_(result.view(tensor.shape))
    return tensor


def _compress(values: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` as packed signs (0 counts as +) and the scale norm/sqrt(n) that makes the
    decompressed tensor as long as `values`; `error` receives what the compression lost."""
    scale = torch.linalg.vector_norm(values) / math.sqrt(values.numel())
    positive = values >= 0
    torch.sub(values, _signs(positive) * scale, out=error)
    return _pack(positive), scale


def _signs(positive: torch.Tensor) -> torch.Tensor:
    return positive.to(torch.float32).mul_(2).sub_(1)


@functools.cache
def _bit_weights(device: torch.device) -> torch.Tensor:
    """The value of each bit of a byte, made once per device (no host copy per call)."""
    return torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)


def _pack(positive: torch.Tensor) -> torch.Tensor:
    """Booleans (a multiple of 8) into uint8, first element in the highest bit."""
    bits = positive.view(-1, 8).to(torch.uint8) * _bit_weights(positive.device)
    return bits.sum(1, dtype=torch.uint8)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 scale as a (1, 4) uint8 row, to ride at the end of a message."""
    return scale.to(torch.float32).reshape(1, 1).view(torch.uint8)


def _decompress(messages: torch.Tensor) -> torch.Tensor:
    """(ranks, bytes) messages of packed signs plus scale into (ranks, elements) fp32 values."""
    packed, scale = messages[:, :-_SCALE_BYTES], messages[:, -_SCALE_BYTES:]
    weights = _bit_weights(messages.device)
    positive = packed.unsqueeze(-1).bitwise_and(weights).ne(0).reshape(len(messages), -1)
    return _signs(positive).mul_(scale.contiguous().view(torch.float32))
