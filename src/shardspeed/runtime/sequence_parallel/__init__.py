"""DeepSpeed's `deepspeed.runtime.sequence_parallel`: what a training loop needs around sequence
parallelism's attention (`shardspeed.sequence`): batches sharded along the sequence, and the loss
each sequence rank contributes. See docs/sequence-parallel.md."""

from .ulysses_sp import UlyssesSPDataLoaderAdapter, shard_batch, shard_cross_entropy

__all__ = ["UlyssesSPDataLoaderAdapter", "shard_batch", "shard_cross_entropy"]
