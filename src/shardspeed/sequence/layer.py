"""DeepSpeed's `deepspeed.sequence.layer`: `DistributedAttention` and its all-to-all function."""

from .ulysses import DistributedAttention, SeqAllToAll, seq_all_to_all

# DeepSpeed's names for the all-to-all function and its functional form.
_SeqAllToAll = SeqAllToAll

__all__ = ["DistributedAttention", "SeqAllToAll", "_SeqAllToAll", "seq_all_to_all"]
