"""`shardspeed.moe` (DeepSpeed's `deepspeed.moe`): mixture of experts.

`gating.TopKGate` routes tokens (top-1 and top-2, capacity and token dropping, noisy gating, random
token selection, the load-balancing loss, and beyond DeepSpeed a temperature and per-expert load
factors); `layer.MoE` is DeepSpeed's layer, with expert parallelism (`ep_size` > 1: experts spread
over an expert group, tokens exchanged all-to-all); `utils` holds DeepSpeed's param-group helpers.
See docs/moe.md.
"""

from . import gating, layer, utils
from .layer import MoE

__all__ = ["MoE", "gating", "layer", "utils"]
