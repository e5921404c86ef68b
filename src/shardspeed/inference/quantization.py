"""Weight-only int8 quantization of a model's linear layers (`dtype` int8 at `init_inference`).

Each weight row (one output channel) is cut into `groups` equal runs of input columns, and each
run gets one symmetric scale, max|w| / 127, so w ~= q * scale with q an int8 in [-127, 127]:
a quarter of fp32's bytes for the weight, plus one scale per run. Activations stay in the model's
dtype: every forward multiplies them by the int8 weight through torch's int8-weight kernel
(`aten._weight_int8pack_mm`, one scale per channel, on CPU) or, elsewhere, by the weight
dequantized on the fly.

`quantize_linears(model)` replaces nn.Linear, Hugging Face's Conv1D and the tensor-parallel
Column/RowParallelLinear layers by `QuantizedLinear`, which keeps a tensor-parallel layer's
communication around the int8 product. By default it leaves out the output head (`lm_head`,
`embed_out`): its errors land directly in the logits, which decide every token, and it is often
tied to the input embedding, whose lookup table is not a linear layer and stays as it is;
quantizing a tied head would store the shared weight twice or break the tie.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    enter_tensor_region,
)
from ..tensor_parallel.mappings import (
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)

__all__ = [
    "DEFAULT_SKIP",
    "QuantizationReport",
    "QuantizedLinear",
    "dequantize",
    "int8_linear",
    "quantize_linears",
    "quantize_weight",
]

DEFAULT_SKIP = (r"(^|\.)lm_head$", r"(^|\.)embed_out$")
QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable


def quantize_weight(weight: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], fp32 scales [out, groups]) of a [out, in] weight."""
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is 2-D, got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if in_features % groups:
        raise ValueError(
            f"{in_features} input columns do not split into {groups} equal quantization groups"
        )
    runs = weight.detach().float().reshape(out_features, groups, in_features // groups)
    scale = runs.abs().amax(dim=-1) / QMAX
    # An all-zero run quantizes to zeros with any scale; 1 avoids dividing by zero.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(runs / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(out_features, in_features), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in `dtype` that `q` and its [out, groups] scales stand for."""
    out_features, groups = scale.shape
    runs = q.reshape(out_features, groups, -1).to(dtype) * scale[..., None].to(dtype)
    return runs.reshape(q.shape)


def _int8_kernel(x: torch.Tensor, scale: torch.Tensor) -> bool:
    return (
        scale.size(1) == 1
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    )


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b for W = dequantize(q, scale), computed in x's dtype."""
    if _int8_kernel(x, scale):
        # Reads the int8 weight as is: a quarter of the memory traffic of an fp32 matmul.
        flat = x.reshape(-1, x.size(-1))
        y = torch.ops.aten._weight_int8pack_mm(flat, q, scale[:, 0].to(x.dtype))
        y = y.reshape(*x.shape[:-1], q.size(0))
        return y if bias is None else y + bias
    return F.linear(x, dequantize(q, scale, x.dtype), bias)


Parallel = Literal["column", "row"] | None


class QuantizedLinear(nn.Module):
    """A linear layer holding its weight in int8 with per-channel (per-group) scales.

    `parallel` "column" / "row" keeps the communication of the tensor-parallel layer it replaces:
    a column layer's input enters the tensor region (unless its parent already did that) and its
    output is gathered if asked; a row layer's partial product is all-reduced (reduce-scattered
    under sequence parallelism) before the bias is added once.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        groups: int = 1,
        *,
        parallel: Parallel = None,
        group: Group = None,
        input_in_region: bool = False,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        q, scale = quantize_weight(weight, groups)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q)
        # fp32 whatever the compute dtype: a bf16 scale alone would add up to 0.4% error per row.
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.parallel, self.group = parallel, group
        self.input_in_region, self.gather_output = input_in_region, gather_output
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel

    @classmethod
    def from_module(cls, layer: nn.Module, groups: int = 1) -> QuantizedLinear:
        """The int8 version of nn.Linear, Conv1D, ColumnParallelLinear or RowParallelLinear."""
        # Conv1D (and split layers built from one) store the weight [in, out].
        transposed = getattr(layer, "transposed", False) or type(layer).__name__ == "Conv1D"
        weight = (layer.weight.t() if transposed else layer.weight).contiguous()
        if isinstance(layer, ColumnParallelLinear):
            return cls(
                weight,
                layer.bias,
                groups,
                parallel="column",
                group=layer.group,
                input_in_region=layer.input_in_region,
                gather_output=layer.gather_output,
                sequence_parallel=layer.sequence_parallel,
            )
        if isinstance(layer, RowParallelLinear):
            return cls(
                weight,
                layer.bias,
                groups,
                parallel="row",
                group=layer.group,
                input_is_parallel=layer.input_is_parallel,
                sequence_parallel=layer.sequence_parallel,
            )
        if isinstance(layer, nn.Linear) or type(layer).__name__ == "Conv1D":
            return cls(weight, layer.bias, groups)
        raise TypeError(f"{type(layer).__name__} is not a linear layer")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self.weight_int8, self.weight_scale
        if self.parallel == "row":
            if not self.input_is_parallel:
                x = scatter_to_tensor_region(x, self.group)
            y = int8_linear(x, q, scale)
            if self.sequence_parallel:
                y = reduce_scatter_to_sequence_region(y, self.group)
            else:
                y = reduce_from_tensor_region(y, self.group)
            return y if self.bias is None else y + self.bias
        if self.parallel == "column" and not self.input_in_region:
            x = enter_tensor_region(x, self.group, self.sequence_parallel)
        y = int8_linear(x, q, scale, self.bias)
        if self.parallel == "column" and self.gather_output:
            y = gather_from_tensor_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"groups={self.weight_scale.size(1)}, parallel={self.parallel}"
        )


@dataclass
class QuantizationReport:
    """What `quantize_linears` did: the layers quantized and left out, and the bytes of the
    quantized layers' weights before (in their dtype) and after (int8 plus scales)."""

    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def ratio(self) -> float:
        """bytes_after / bytes_before (about 0.25 from fp32, 0.5 from fp16 / bf16)."""
        return self.bytes_after / self.bytes_before if self.bytes_before else 1.0

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"int8: {len(self.quantized)} linear layers quantized, {len(self.skipped)} left out "
            f"({', '.join(self.skipped) or 'none'}); their weights {self.bytes_before / mib:.2f} "
            f"MiB -> {self.bytes_after / mib:.2f} MiB ({self.ratio:.1%})"
        )


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | ColumnParallelLinear | RowParallelLinear) or (
        type(module).__name__ == "Conv1D"
    )


@torch.no_grad()
def quantize_linears(
    model: nn.Module, skip: Sequence[str] = DEFAULT_SKIP, groups: int = 1
) -> QuantizationReport:
    """Replace `model`'s linear layers by int8 `QuantizedLinear`s in place.

    `skip`: regular expressions searched in module names; matching layers stay as they are (by
    default the output head, see the module docstring). A layer whose weight another module also
    uses (a tied head) is always left out. `groups`: scales per output channel.
    """
    report = QuantizationReport()
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for name, module in list(model.named_modules()):
        if not _linear_like(module):
            continue
        tied = owners.get(id(module.weight), 0) > 1
        if tied or any(re.search(pattern, name) for pattern in skip):
            report.skipped.append(name)
            continue
        quantized = QuantizedLinear.from_module(module, groups)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized)
        report.quantized.append(name)
        report.bytes_before += module.weight.numel() * module.weight.element_size()
        report.bytes_after += sum(
            t.numel() * t.element_size() for t in (quantized.weight_int8, quantized.weight_scale)
        )
    return report
