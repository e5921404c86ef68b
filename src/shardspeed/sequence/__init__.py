"""Sequence parallelism: attention over a sequence split across the ranks of a sequence group.

`DistributedAttention` (DeepSpeed's Ulysses) trades the sequence shard for a head shard with
all-to-alls; `ring_attention` passes key/value blocks around a ring and takes any head count;
`sequence_attention` runs either or both (hybrid) over a sequence group cut by
`Topology.sequence_split`. The caller gives the process groups (see docs/sequence-parallel.md).
"""

from .hybrid import sequence_attention, shard_sequence, unshard_sequence
from .ring import RingAttention, ring_attention, shard_load_balanced, unshard_load_balanced
from .ulysses import DistributedAttention, SeqAllToAll, seq_all_to_all

__all__ = [
    "DistributedAttention",
    "RingAttention",
    "SeqAllToAll",
    "ring_attention",
    "seq_all_to_all",
    "sequence_attention",
    "shard_load_balanced",
    "shard_sequence",
    "unshard_load_balanced",
    "unshard_sequence",
]
