"""A paged key/value cache: one preallocated tensor cut into fixed-size blocks of token slots,
handed to sequences as they grow (the layout of vLLM's PagedAttention, in plain torch).

Each sequence owns a block table, the list of its blocks in token order; token p of a sequence
lives in slot p % block_size of block table[p // block_size], in every layer. A sequence takes
blocks only when it needs them and gives them all back when it ends, so memory follows the tokens
actually held rather than the longest sequence times the batch size, and a finished sequence's
blocks go straight to the next request.

`gather` reassembles a batch as dense [B, kv_heads, Tmax, head_dim] tensors, right-aligned: each
sequence's tokens end at column Tmax - 1 and the padding (zeros) is on the left. The adapters
append every sequence's new tokens before gathering, and a step gives every sequence of a batch
the same number of new tokens, so the new tokens fill the same last columns in every row. That is
what a causal mask indexed by column needs (Hugging Face's `create_causal_mask` with a 2D padding
mask is one), and it is how Hugging Face left-pads batched generation.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

__all__ = ["BlockKVCache", "OutOfBlocksError"]


class OutOfBlocksError(RuntimeError):
    """The cache has too few free blocks for an append (nothing was allocated or written)."""


class BlockKVCache:
    """Keys and values of many sequences in `num_blocks` blocks of `block_size` tokens.

    Storage is one tensor [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]
    (2: keys, values), allocated once and zeroed, so padding gathered from it is always finite.
    All layers of a sequence share its block table.

    Within one model step every layer appends the same number of tokens to a sequence; a layer
    that appends out of step (twice before the others caught up, or a different count) raises, since
    that would silently misplace positions. `length` is what all layers hold.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(
            num_layers,
            2,
            num_blocks * block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )
        # A stack popped from the end: reversed so that a fresh cache hands out block 0 first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, list[int]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens of one sequence."""
        return math.ceil(num_tokens / self.block_size)

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence (it takes no block until its first append)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        self._tables[seq_id] = []
        self._lengths[seq_id] = [0] * self.num_layers

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def _check(self, seq_id: Hashable) -> list[int]:
        if seq_id not in self._lengths:
            raise KeyError(f"sequence {seq_id!r} is not in the cache (add_sequence first)")
        return self._lengths[seq_id]

    def length(self, seq_id: Hashable) -> int:
        """Tokens every layer of the sequence holds."""
        return min(self._check(seq_id))

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks in token order (a copy)."""
        self._check(seq_id)
        return list(self._tables[seq_id])

    def free(self, seq_id: Hashable) -> None:
        """End a sequence and return its blocks to the free list."""
        self._check(seq_id)
        self._free.extend(reversed(self._tables.pop(seq_id)))
        del self._lengths[seq_id]

    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def free_blocks(self) -> int:
        return len(self._free)

    def bytes(self) -> int:
        """Bytes of the preallocated storage (all blocks, used or not)."""
        return self.storage.numel() * self.storage.element_size()

    def append(self, seq_id: Hashable, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one sequence's new keys and values [kv_heads, T, head_dim] to `layer`."""
        self.append_batch([seq_id], layer, k.unsqueeze(0), v.unsqueeze(0))

    def append_batch(
        self, seq_ids: Sequence[Hashable], layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Append T new tokens to each of `seq_ids` at `layer`; k, v: [B, kv_heads, T, head_dim].

        Blocks are taken as needed, all or none: when the free list cannot cover the whole batch,
        `OutOfBlocksError` is raised before anything changes.
        """
        expected = (len(seq_ids), self.num_kv_heads, self.head_dim)
        if k.dim() != 4 or v.shape != k.shape or (k.size(0), k.size(1), k.size(3)) != expected:
            raise ValueError(
                f"keys/values of shape {tuple(k.shape)}/{tuple(v.shape)}, expected "
                f"[batch={len(seq_ids)}, kv_heads={self.num_kv_heads}, T, head_dim={self.head_dim}]"
            )
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one append: {list(seq_ids)}")
        new = k.size(2)
        starts = []
        needed = 0
        for seq_id in seq_ids:
            lengths = self._check(seq_id)
            start, lo, hi = lengths[layer], min(lengths), max(lengths)
            # Either all layers are level (this append opens a step) or this layer catches up
            # with the ones that already appended this step.
            if not (lo == hi or (start < hi and start + new == hi)):
                raise ValueError(
                    f"layer {layer} of sequence {seq_id!r} appends {new} tokens at {start}, out of "
                    f"step with its other layers (they hold {lo} to {hi}): every layer must append "
                    f"the same tokens once per step"
                )
            starts.append(start)
            needed += max(0, self.blocks_for(start + new) - len(self._tables[seq_id]))
        if needed > len(self._free):
            raise OutOfBlocksError(
                f"appending {new} tokens to {len(seq_ids)} sequences needs {needed} more blocks of "
                f"{self.block_size} tokens but only {len(self._free)} of {self.num_blocks} are free"
            )
        slots = []
        for seq_id, start in zip(seq_ids, starts):
            table = self._tables[seq_id]
            while len(table) < self.blocks_for(start + new):
                table.append(self._free.pop())
            slots.extend(
                table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, start + new)
            )
            self._lengths[seq_id][layer] = start + new
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        # [B, kv_heads, T, head_dim] -> one row per token, in the order of `slots`.
        rows_k = k.detach().transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        rows_v = v.detach().transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        self.storage[layer, 0].index_copy_(0, index, rows_k.to(self.dtype))
        self.storage[layer, 1].index_copy_(0, index, rows_v.to(self.dtype))

    def gather(
        self, seq_ids: Sequence[Hashable], layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` for `seq_ids`, right-aligned and zero-padded on the left.

        Returns (k, v, lengths): k and v [B, kv_heads, Tmax, head_dim] where Tmax is the longest
        of them, and lengths int64 [B] on the cache's device; row b's tokens are in columns
        Tmax - lengths[b] .. Tmax - 1.
        """
        lengths = [self._check(s)[layer] for s in seq_ids]
        batch, longest = len(seq_ids), max(lengths, default=0)
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        if longest == 0:
            empty = self.storage.new_zeros(batch, self.num_kv_heads, 0, self.head_dim)
            return empty, empty.clone(), lengths_t.to(self.device)
        widest = max(len(self._tables[s]) for s in seq_ids)
        tables = torch.zeros(batch, widest, dtype=torch.long)
        for b, seq_id in enumerate(seq_ids):
            table = self._tables[seq_id]
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.long)
        # Token position held by each output column; negative in the left padding.
        pos = torch.arange(longest) - (longest - lengths_t)[:, None]
        pad = pos < 0
        pos = pos.clamp(min=0)
        slots = tables.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size
        slots, pad = slots.to(self.device), pad.to(self.device)[..., None, None]
        # Padding columns read some slot of the row's first block and are zeroed, so attention
        # that gives them zero weight never multiplies stale (or another sequence's) values.
        k = self.storage[layer, 0][slots].masked_fill(pad, 0).transpose(1, 2)
        v = self.storage[layer, 1][slots].masked_fill(pad, 0).transpose(1, 2)
        return k, v, lengths_t.to(self.device)
