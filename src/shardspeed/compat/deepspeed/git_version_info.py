"""DeepSpeed's `deepspeed.git_version_info`: what a build of DeepSpeed reports about itself.

shardspeed builds nothing, so `installed_ops` is all False (no op is compiled ahead of time) and
`torch_info` holds DeepSpeed's "0.0" sentinel, which its readers take as "detect at run time".
"""

from shardspeed.compat import DEEPSPEED_VERSION

from .ops.op_builder import ALL_OPS

version = DEEPSPEED_VERSION
git_hash = "[none]"
git_branch = "[none]"
installed_ops = dict.fromkeys(ALL_OPS, False)
compatible_ops = {name: builder.is_compatible() for name, builder in ALL_OPS.items()}
accelerator_name = ""
torch_info = {
    "version": "0.0",
    "bf16_support": False,
    "cuda_version": "0.0",
    "nccl_version": "0.0",
    "hip_version": "0.0",
}
