"""Sequence-sharded batches and their loss (DeepSpeed's `runtime.sequence_parallel.ulysses_sp`).

The rule that makes sequence-parallel training equal whole-sequence training:

- Labels are shifted before the sequence is cut (`shift_labels[t]` is `labels[t + 1]`, the last
  position ignored), so a slice's last token is scored against the next slice's first label.
- Each sequence rank's loss is the sum of its slice's per-token losses divided by the labelled
  tokens of the whole batch across the sequence group (`shard_cross_entropy`). The ranks' losses
  add up to the whole sequence's mean token loss, and so do their gradients.
- The engine sums gradients over the sequence ranks and averages them over the data-parallel
  replicas (it divides the data x sequence sum by the data-parallel size, as DeepSpeed does).

Code that instead gives every sequence rank the whole loss (transformers' Trainer, DeepSpeed's
ALST tutorial) needs its gradients averaged over the sequence ranks too: `loss_convention` tells
the two apart from the loss values themselves, and the engine asks it at the first step.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import comm
from ...config.errors import ConfigError
from ...sequence import shard_sequence

# DeepSpeed keeps ALST's Hugging Face attention and tiled compute in this module; shardspeed's
# live in `huggingface` and `tiled`.
from .huggingface import UlyssesSPAttentionHF as UlyssesSPAttentionHF
from .plan import current_plan
from .tiled import SequenceTiledCompute as SequenceTiledCompute
from .tiled import TiledFusedLogitsLoss as TiledFusedLogitsLoss
from .tiled import TiledMLP as TiledMLP
from .tiled import sequence_tiled_compute as sequence_tiled_compute

IGNORE_INDEX = -100
logger = logging.getLogger("shardspeed")


def shard_batch(
    batch: dict[str, Any], sp_rank: int, sp_world_size: int, ring_size: int = 1
) -> dict[str, Any]:
    """This rank's slice of `batch` along the sequence (dim 1 of every tensor), with `labels`
    replaced by `shift_labels` shifted before the cut, in the layout of `shard_sequence` for
    `ring_size` ring blocks: 1 (contiguous slices in rank order) suits Ulysses
    (`DistributedAttention`), `sp_world_size` is the load-balanced layout causal `ring_attention`
    needs, and a size between is hybrid's. Other entries are kept as they are."""
    if "labels" not in batch or "position_ids" not in batch:
        raise ValueError(
            "a sequence-parallel batch needs 'labels' and 'position_ids' (for unpacked "
            "sequences, torch.arange(seq_len) per sample): each token keeps its global position "
            "and its next-token label after the sequence is cut"
        )
    seq_len = batch["input_ids"].shape[1] if "input_ids" in batch else batch["labels"].shape[1]
    if seq_len % sp_world_size:
        raise ValueError(
            f"the sequence length {seq_len} is not a multiple of the sequence-parallel size "
            f"{sp_world_size}: pad the batch's sequences to a multiple of {sp_world_size}"
        )
    whole = dict(batch)
    labels = whole.pop("labels")
    whole["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    sliced = {}
    for key, value in whole.items():
        if not torch.is_tensor(value):
            sliced[key] = value
        elif value.dim() < 2 or value.shape[1] != seq_len:
            raise ValueError(
                f"batch['{key}'] has shape {tuple(value.shape)}: every tensor of a "
                f"sequence-parallel batch is [batch, {seq_len}, ...] like the labels"
            )
        else:
            sliced[key] = shard_sequence(value, 1, sp_rank, sp_world_size, ring_size).contiguous()
    return sliced


def shard_cross_entropy(
    logits: torch.Tensor, shift_labels: torch.Tensor, sp_group: Any
) -> torch.Tensor:
    """This rank's part of the whole batch's mean next-token loss: the summed cross-entropy of
    its slice (labels `IGNORE_INDEX` skipped) over the labelled tokens of every slice in
    `sp_group`. Summed over the group it is the whole sequence's loss; each rank backpropagates
    its own part (see the module docstring). Collective over `sp_group`."""
    summed = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    tokens = (shift_labels != IGNORE_INDEX).sum().to(device=logits.device, dtype=torch.float32)
    comm.all_reduce(tokens, group=sp_group)
    return summed / tokens.clamp(min=1.0)


# Replicated losses are one computation's result on every rank, so they agree to the last bit;
# the tolerance only keeps a reduction done in another order from reading as sharded.
_SAME_LOSS_RTOL = 1e-6


def loss_convention(loss: torch.Tensor, sp_group: Any) -> tuple[str | None, list[float]]:
    """How the sequence ranks' losses relate, and the values seen (in group rank order):
    'replicated' when every rank of `sp_group` holds the same value (the whole sequence's loss),
    'sharded' when they differ (each holds its slice's part), None when the values cannot tell
    (a non-finite loss, or zero everywhere). One small all-gather over `sp_group` and a host
    sync: call it once, not every step."""
    size = comm.get_world_size(sp_group)
    mine = loss.detach().reshape(1).to(torch.float64)
    values = torch.empty(size, dtype=torch.float64, device=mine.device)
    comm.all_gather_into_tensor(values, mine, group=sp_group)
    if values.is_meta:  # a dry run (`shardspeed.planning`): no values to tell by
        return None, []
    seen = values.tolist()
    if not all(math.isfinite(v) for v in seen) or not any(seen):
        return None, seen
    same = max(seen) - min(seen) <= _SAME_LOSS_RTOL * max(abs(v) for v in seen)
    return ("replicated" if same else "sharded"), seen


class SequenceLoss:
    """The engine's part that settles, from the loss handed to the first backward, whether the
    sequence ranks' gradients are summed (sharded loss) or averaged (replicated loss), and
    refuses a 'sequence_parallel.loss' that says the other. See docs/sequence-parallel.md."""

    def __init__(self, said: str | None, topology: Any, optimizer: Any) -> None:
        self.said, self.topology, self.optimizer = said, topology, optimizer

    def settle(self, loss: torch.Tensor) -> bool:
        """Settle it from `loss` and return True, or return False for a loss that cannot tell
        (zero, non-finite): the next one is asked."""
        topology = self.topology
        seen, values = loss_convention(loss, topology.get_sequence_parallel_group())
        if seen is None and loss.is_meta:
            # A dry run's loss has no value: the stated convention, else the one of transformers'
            # Trainer and ALST's tutorial. Either moves the same bytes.
            seen = self.said or "replicated"
        if seen is None:
            return False
        if self.said is not None and self.said != seen:
            shown = ", ".join(f"{v:.6g}" for v in values)
            found = (
                "the same value on every sequence rank (the whole loss)"
                if seen == "replicated"
                else "a different value on each sequence rank (each rank's part)"
            )
            raise ConfigError(
                f"'sequence_parallel.loss' is '{self.said}', but the loss handed to backward() "
                f"at the first step is {found}: {shown}. Set 'sequence_parallel.loss' to "
                f"'{seen}' or leave it out (the engine then follows what the loss shows)"
            )
        sp = topology.sp_world_size
        self.optimizer.set_sequence_split(1 if seen == "replicated" else sp)
        if topology.rank == 0:
            logger.info(
                "sequence parallelism: the loss is %s over the %d sequence ranks, so their "
                "gradients are %s",
                seen,
                sp,
                "averaged" if seen == "replicated" else "summed",
            )
        return True


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's adapter: wraps a loader whose every rank yields its own batches
    (`[batch, seq, ...]` tensors with `input_ids`, `labels`, `position_ids`), and makes the
    sequence group train on each of them in turn.

    Each refill takes one batch from every rank of `sp_group`; the next `sp_world_size` items are
    this rank's slice (`shard_batch`) of rank 0's batch, then rank 1's, and so on. So `len()` is
    the wrapped loader's length times `sp_world_size`, and `sp_world_size` items equal one step of
    plain data parallelism. Slices are on the host, as DeepSpeed leaves them; `device` is where
    the exchange runs. `ring_size` (a shardspeed addition) sets the layout (see `shard_batch`);
    left out, it is the running job's (the config's `sequence_parallel.mode`), read when batches
    are cut, since accelerate makes the adapter before `initialize`.
    """

    def __init__(
        self,
        dl: Iterable[dict[str, Any]],
        sp_rank: int,
        sp_group: Any,
        sp_world_size: int,
        device: Any,
        *,
        ring_size: int | None = None,
    ) -> None:
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = torch.device(device)
        self.ring_size = ring_size
        self.first_length: int | None = None
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather one batch from every rank of the group and queue this rank's slices of them.
        At the end of the wrapped loader it restarts it (the next epoch) and stops this one."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        plan = current_plan()
        ring_size = self.ring_size or plan.ring_size(self.sp_world_size)
        for gathered in self._gather(batch):
            if plan.fixed_length:
                self._check_length(gathered["input_ids"].shape[1])
            self.micro_batches.append(
                {
                    key: value.cpu() if torch.is_tensor(value) else value
                    for key, value in shard_batch(
                        gathered, self.sp_rank, self.sp_world_size, ring_size
                    ).items()
                }
            )

    def _check_length(self, length: int) -> None:
        self.first_length = self.first_length or length
        if length != self.first_length:
            raise ValueError(
                f"a batch has sequence length {length} after one of {self.first_length}, but "
                "the config's 'sequence_parallel.ulysses.seq_length_is_variable' is false: pad "
                "every batch to one length, or set it true"
            )

    def _gather(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Every group rank's batch, in rank order. Sequence lengths may differ between ranks (each
        tensor goes out padded to the longest and comes back trimmed); the other dimensions of a
        key must agree."""
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses sequence parallelism needs 'position_ids' in every batch, so that each "
                "token keeps its global position after the sequence is cut: add them in the "
                "data collator (torch.arange(seq_len) per unpacked sample)"
            )
        seq_len = batch["input_ids"].shape[1]
        lengths = torch.zeros(self.sp_world_size, dtype=torch.int64, device=self.device)
        lengths[self.sp_rank] = seq_len
        comm.all_reduce(lengths, group=self.sp_group)
        lengths_list = lengths.tolist()
        longest = max(lengths_list)
        batches: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                if value.dim() < 2 or value.shape[1] != seq_len:
                    raise ValueError(
                        f"batch['{key}'] has shape {tuple(value.shape)}, but input_ids has "
                        f"sequence length {seq_len}: every tensor is [batch, seq, ...]"
                    )
                padded = value.new_zeros((value.shape[0], longest, *value.shape[2:]))
                padded[:, :seq_len] = value
                padded = padded.to(self.device)
                received = [torch.empty_like(padded) for _ in lengths_list]
                comm.all_gather(received, padded, group=self.sp_group)
                pieces: list[Any] = [r[:, :n] for r, n in zip(received, lengths_list)]
            else:
                pieces = [None] * self.sp_world_size
                dist.all_gather_object(pieces, value, group=self.sp_group)
            for rank_batch, piece in zip(batches, pieces):
                rank_batch[key] = piece
        return batches
