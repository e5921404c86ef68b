"""Block quantization for ZeRO++'s compressed collectives (arXiv:2306.10209).

A tensor is cut into blocks of `block` elements; each block is scaled by its largest magnitude so
that it fits the signed integers of `bits` bits (symmetric, round to nearest). The error of every
element is at most half its block's step: |x - dequantize(quantize(x))| <= absmax(block) /
(2 * (2 ** (bits - 1) - 1)). Large and small values in different blocks keep their own scales,
which is what keeps the error bounded where one scale for the whole tensor would not.

A quantized tensor travels as one byte payload, the integers then the fp32 scales, so that one
collective carries both. Rows are quantized independently (`x` of shape (rows, n)), which is how
an all-gather or an all-to-all lays out what each rank sends.
"""

from __future__ import annotations

import torch

# DeepSpeed's ZeRO++ quantizes weights in int8 and gradients in int4.
WEIGHT_BITS = 8
GRADIENT_BITS = 4
BLOCK = 256  # elements per scale: 4 bytes of scale per 256 values, 1.6% over int8


def qmax(bits: int) -> int:
    """The largest integer a block's largest magnitude maps to."""
    return 2 ** (bits - 1) - 1


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def payload_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of the payload of `numel` elements: the integers, then one fp32 scale per block."""
    padded = _blocks(numel, block) * block
    return padded * bits // 8 + _blocks(numel, block) * 4


def quantize(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """Each row of `x` (1-D: one row) as a uint8 payload of `payload_bytes(x.shape[-1], bits,
    block)` bytes."""
    if bits not in (4, 8):
        raise ValueError(f"block quantization has 4 or 8 bits, not {bits}")
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    numel = rows.shape[1]
    padded = _blocks(numel, block) * block
    values = rows.float()
    if padded != numel:
        values = torch.nn.functional.pad(values, (0, padded - numel))
    values = values.view(rows.shape[0], -1, block)
    scales = values.abs().amax(dim=-1, keepdim=True) / qmax(bits)
    # An all-zero block has scale 0: divide by 1 instead, its integers are 0 either way.
    integers = torch.round(values / torch.where(scales > 0, scales, 1.0)).to(torch.int8)
    if bits == 8:
        packed = integers.view(torch.uint8).reshape(rows.shape[0], -1)
    else:
        nibbles = (integers + 8).to(torch.uint8).reshape(rows.shape[0], -1, 2)
        packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scale_bytes = scales.reshape(rows.shape[0], -1).contiguous().view(torch.uint8)
    payload = torch.cat([packed, scale_bytes], dim=1)
    return payload.reshape(*x.shape[:-1], -1) if x.dim() > 1 else payload.reshape(-1)


def dequantize(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    block: int = BLOCK,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The values of each row of `payload` (rows of `numel` elements), written into `out` when
    given (its dtype wins)."""
    rows = payload.reshape(-1, payload.shape[-1])
    count = _blocks(numel, block)
    padded = count * block
    integer_bytes = padded * bits // 8
    scales = rows[:, integer_bytes:].contiguous().view(torch.float32).view(rows.shape[0], count, 1)
    packed = rows[:, :integer_bytes]
    if bits == 8:
        integers = packed.contiguous().view(torch.int8)
    else:
        low = (packed & 0x0F).to(torch.int8) - 8
        high = (packed >> 4).to(torch.int8) - 8
        integers = torch.stack([low, high], dim=-1).reshape(rows.shape[0], -1)
    values = (integers.view(rows.shape[0], count, block).float() * scales).reshape(
        rows.shape[0], padded
    )[:, :numel]
    shape = (*payload.shape[:-1], numel)
    if out is None:
        return values.to(dtype).reshape(shape)
    out.view(rows.shape[0], numel).copy_(values)
    return out


def error_bound(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """The largest error quantizing each row of `x` can make: half the coarsest block's step."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    padded = _blocks(rows.shape[1], block) * block
    values = torch.nn.functional.pad(rows.float(), (0, padded - rows.shape[1]))
    return values.view(rows.shape[0], -1, block).abs().amax(dim=(1, 2)) / (2 * qmax(bits))
