"""DeepSpeed's `deepspeed.ops.op_builder`, for code that asks whether an op can run.

DeepSpeed compiles its kernels with these builders. shardspeed compiles nothing: the ops it has are
written in torch and always available, so their builders say they are compatible and `load()`
points to the torch implementation; the rest say they are not, and `load()` says what is missing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar


class OpBuilder:
    """One DeepSpeed op: `NAME`, whether it can run (`is_compatible`), and `load`."""

    NAME: ClassVar[str] = "deepspeed_not_implemented"
    # The shardspeed name that does this op's work, or "" for an op shardspeed does not have.
    PROVIDED_BY: ClassVar[str] = ""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return bool(self.PROVIDED_BY)

    def builder(self) -> Any:
        raise RuntimeError(f"shardspeed builds no compiled ops; {self._availability()}")

    def load(self, verbose: bool = True) -> Any:
        raise RuntimeError(
            f"the '{self.name}' op has no compiled kernel in shardspeed: {self._availability()}"
        )

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)

    def _availability(self) -> str:
        if self.PROVIDED_BY:
            return f"use {self.PROVIDED_BY}, which runs on torch"
        return "shardspeed does not provide this op"

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def installed_cuda_version(name: str = "") -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def is_rocm_pytorch() -> bool:
        return False


def _builder(class_name: str, name: str, provided_by: str = "") -> type[OpBuilder]:
    return type(
        class_name, (OpBuilder,), {"NAME": name, "PROVIDED_BY": provided_by, "__module__": __name__}
    )


class UtilsBuilder(OpBuilder):
    """DeepSpeed's flatten / unflatten op, which torch has."""

    NAME = "utils"
    PROVIDED_BY = "torch._utils._flatten_dense_tensors"

    def load(self, verbose: bool = True) -> Any:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        return SimpleNamespace(flatten=_flatten_dense_tensors, unflatten=_unflatten_dense_tensors)


CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam")
CPUAdagradBuilder = _builder(
    "CPUAdagradBuilder", "cpu_adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"
)
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion", "deepspeed.ops.lion.DeepSpeedCPULion")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", "deepspeed.ops.adam.FusedAdam")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb", "deepspeed.ops.lamb.FusedLamb")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion", "deepspeed.ops.lion.FusedLion")
AsyncIOBuilder = _builder(
    "AsyncIOBuilder", "async_io", "the NVMe offload of shardspeed.zero.swap (a thread pool)"
)
NotImplementedBuilder = _builder("NotImplementedBuilder", "deepspeed_not_implemented")
# DeepSpeed's kernels that shardspeed does not have.
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm")
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm")
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory")
DeepCompileBuilder = _builder("DeepCompileBuilder", "dc")
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn")
FPQuantizerBuilder = _builder("FPQuantizerBuilder", "fp_quantizer")
FlashAttentionBuilder = _builder("FlashAttentionBuilder", "flash_attn")
GDSBuilder = _builder("GDSBuilder", "gds")
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference")
InferenceCoreBuilder = _builder("InferenceCoreBuilder", "inference_core_ops")
InferenceCutlassBuilder = _builder("InferenceCutlassBuilder", "cutlass_ops")
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer")
RaggedOpsBuilder = _builder("RaggedOpsBuilder", "ragged_device_ops")
RaggedUtilsBuilder = _builder("RaggedUtilsBuilder", "ragged_ops")
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd")
SpatialInferenceBuilder = _builder("SpatialInferenceBuilder", "spatial_inference")
StochasticTransformerBuilder = _builder("StochasticTransformerBuilder", "stochastic_transformer")
TransformerBuilder = _builder("TransformerBuilder", "transformer")

# DeepSpeed's `op_builder.all_ops.ALL_OPS`: op name -> builder instance.
ALL_OPS: dict[str, OpBuilder] = {
    builder.NAME: builder()
    for builder in (
        NotImplementedBuilder,
        AsyncIOBuilder,
        CCLCommBuilder,
        ShareMemCommBuilder,
        CPUAdagradBuilder,
        CPUAdamBuilder,
        CPULionBuilder,
        FusedAdamBuilder,
        FusedLambBuilder,
        FusedLionBuilder,
        PinMemoryBuilder,
        UtilsBuilder,
        DeepCompileBuilder,
        EvoformerAttnBuilder,
        FPQuantizerBuilder,
        FlashAttentionBuilder,
        GDSBuilder,
        InferenceBuilder,
        InferenceCoreBuilder,
        InferenceCutlassBuilder,
        QuantizerBuilder,
        RaggedOpsBuilder,
        RaggedUtilsBuilder,
        RandomLTDBuilder,
        SpatialInferenceBuilder,
        StochasticTransformerBuilder,
        TransformerBuilder,
    )
}
