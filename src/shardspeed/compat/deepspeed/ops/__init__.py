"""Missing parts of DeepSpeed's `deepspeed.ops`: the op builders, and `__compatible_ops__`."""

from .op_builder import ALL_OPS

# DeepSpeed's table of which ops this machine can run: here, the ones shardspeed has in torch.
__compatible_ops__ = {name: builder.is_compatible() for name, builder in ALL_OPS.items()}

__all__ = ["__compatible_ops__"]
