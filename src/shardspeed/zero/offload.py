"""Optimizer states away from the device: in CPU memory, or in NVMe files between steps.

CPU offload keeps the fp32 masters and the optimizer states in (pinned, where a GPU exists) host
memory: gradients are copied there, the torch optimizer steps there, and the updated masters are
copied back into the model. On a machine without a GPU everything is host memory already, so
nothing moves.

NVMe offload adds `SwappedStates`: each master tensor (at most `sub_group_size` elements: the
layout splits param groups that far) is stepped on its own, its per-element states (Adam's
moments) read from its swap files just before and written back just after. With
`pipeline_read` the next master's states are read while the current one steps; with
`pipeline_write` a written master's buffers are released when the write completes, in the
background; `buffer_count` bounds the masters whose states are in memory at once.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .swap import AioOptions, NvmeSwapper, aligned_empty


@dataclass(frozen=True)
class OffloadOptions:
    """`zero_optimization.offload_optimizer` and `aio`, as the optimizer needs them."""

    device: str = "none"  # none, cpu or nvme
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    sub_group_size: int = 1_000_000_000
    aio: AioOptions = field(default_factory=AioOptions)
    param_device: str = "none"  # offload_param: where stage 3's shards live (none, cpu, nvme)
    param_nvme_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @classmethod
    def from_config(cls, config: Any) -> OffloadOptions:
        """From the validated config: `zero_optimization.offload_optimizer`, `offload_param`,
        `sub_group_size` and `aio`."""
        zero, aio = config.zero_optimization, config.aio
        if zero.stage == 0:
            # The loader warned that offloading acts only from stage 1 (parameters: stage 3).
            return cls()
        offload = zero.offload_optimizer
        return cls(
            device=offload.device,
            nvme_path=offload.nvme_path,
            pin_memory=offload.pin_memory,
            buffer_count=offload.buffer_count,
            pipeline_read=offload.pipeline_read,
            pipeline_write=offload.pipeline_write,
            sub_group_size=zero.sub_group_size,
            param_device=zero.offload_param.device,
            param_nvme_path=zero.offload_param.nvme_path,
            aio=AioOptions(
                block_size=aio.block_size,
                queue_depth=aio.queue_depth,
                thread_count=aio.intra_op_parallelism,
                single_submit=aio.single_submit,
                overlap_events=aio.overlap_events,
            ),
        )


def per_element(value: Any, numel: int) -> bool:
    """An optimizer state with one value per element of a master of `numel` elements (Adam's
    moments, not its 0-dimensional step); the master itself may be swapped out right now."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


class SwappedStates:
    """Keeps each master's per-element optimizer states in files, in memory only around its step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        sizes: list[int],
        options: OffloadOptions,
        rank: int,
        values: Any = None,
    ) -> None:
        """`values`: a `SwappedShard` holding the masters themselves (parameter offload to NVMe),
        whose pieces are then read and written around each step like the states."""
        self.optimizer, self.masters, self.options = optimizer, masters, options
        self.sizes, self.values = sizes, values
        self.swapper = NvmeSwapper(options.nvme_path, rank, options.aio)
        self._names: list[list[str]] = [[] for _ in masters]  # state names on disk, per master
        self._reads: dict[int, list[tuple[str, torch.Tensor, Future]]] = {}
        # Per master written, its pending writes (each holding its tensor until done).
        self._writes: deque[list[tuple[Future, torch.Tensor]]] = deque()
        # Read buffers, reused: a fixed set keeps resident memory flat (freed and reallocated
        # buffers of this size would stay in the allocator's arena anyway).
        self._largest = max(sizes)
        return_large_blocks_to_the_os()
        self._free: list[torch.Tensor] = []
        self._pooled: set[int] = set()

    def close(self) -> None:
        self.swapper.close()

    def bytes_on_disk(self) -> int:
        return self.swapper.bytes_on_disk()

    def check_space(self) -> None:
        """Before training: room for two fp32 moments of every master on `nvme_path`."""
        self.swapper.check_space(sum(2 * 4 * size for size in self.sizes))

    # -- the step -------------------------------------------------------------------------------

    def step(self, grads: torch.Tensor, keep: bool) -> None:
        """Step the optimizer one master at a time on its part of `grads` (aligned with the
        masters), each between reading and writing its states. Gradients are attached only
        around each master's own step, so `keep` changes nothing here."""
        del keep
        grads = grads.split(self.sizes)
        for m in self.masters:
            m.grad = None
        for k, master in enumerate(self.masters):
            self._swap_in(k)
            if self.options.pipeline_read and k + 1 < len(self.masters):
                self._start_read(k + 1)
            master.grad = grads[k]
            self.optimizer.step()  # the other masters have no gradient: torch optimizers skip them
            master.grad = None
            self._swap_out(k)
        self._drain_writes(0)

    def _start_read(self, k: int) -> None:
        if k in self._reads or not (self._names[k] or self.values is not None):
            return
        self._drain_writes(self.options.buffer_count - 2)
        reads = []
        for name in self._names[k]:
            buffer = self._buffer()[: self.sizes[k]]
            reads.append((name, buffer, self.swapper.read(f"{k}.{name}", buffer)))
        if self.values is not None:
            reads.append((None, *self.values.read_async(k)))
        self._reads[k] = reads

    def _swap_in(self, k: int) -> None:
        """Master `k`'s states (and values, if swapped) in memory, read now or by the read-ahead."""
        self._start_read(k)
        state = self.optimizer.state[self.masters[k]]
        for name, buffer, done in self._reads.pop(k, []):
            done.result()
            if name is None:
                self.masters[k].data = buffer
            else:
                state[name] = buffer

    def _swap_out(self, k: int) -> None:
        master = self.masters[k]
        state = self.optimizer.state[master]
        names = [n for n, v in state.items() if per_element(v, self.sizes[k])]
        pending = []
        for name in names:
            tensor = state[name]
            if not self._names[k]:
                self.swapper.reserve(f"{k}.{name}", tensor.numel() * tensor.element_size())
            pending.append((self.swapper.write(f"{k}.{name}", tensor), tensor))
            state[name] = _EMPTY  # the file holds it now; memory goes when the write completes
        if self.values is not None:
            pending.append((self.values.write_async(k, master.data), master.data))
            master.data = _EMPTY
        self._names[k] = names
        self._writes.append(pending)
        self._drain_writes(self.options.buffer_count - 2 if self.options.pipeline_write else 0)

    def _drain_writes(self, keep: int) -> None:
        """Wait for the oldest masters' writes until at most `keep` masters' are in flight."""
        while len(self._writes) > max(keep, 0):
            for done, tensor in self._writes.popleft():
                done.result()
                self._release(tensor)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_of(self, k: int) -> dict[str, Any]:
        """Master `k`'s whole optimizer state, its swapped states read back (for a save)."""
        self._drain_writes(0)
        state = dict(self.optimizer.state.get(self.masters[k], {}))
        for name in self._names[k]:
            buffer = aligned_empty(self.sizes[k], torch.float32)
            self.swapper.read(f"{k}.{name}", buffer).result()
            state[name] = buffer
        return state

    def load(self, state_dict: dict[str, Any]) -> None:
        """`optimizer.load_state_dict`, then every master's loaded states written out to files."""
        self.optimizer.load_state_dict(state_dict)
        for k in range(len(self.masters)):
            if self.values is not None:
                self.masters[k].data = self.values.piece(k)
            self._swap_out(k)
        self._drain_writes(0)

    def _buffer(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        buffer = aligned_empty(self._largest, torch.float32, pin=self.options.pin_memory)
        self._pooled.add(buffer.data_ptr())
        return buffer

    def _release(self, tensor: torch.Tensor) -> None:
        """A written tensor: back to the pool if it is a pool buffer (else it is simply freed)."""
        if tensor.data_ptr() in self._pooled:
            self._free.append(tensor.view(-1).as_strided((self._largest,), (1,)))


_EMPTY = torch.empty(0)


def return_large_blocks_to_the_os() -> None:
    """Keep glibc from parking freed multi-megabyte blocks in its heap.

    glibc serves a large allocation with mmap, but after one is freed it raises its threshold to
    that size, so later ones come from the heap and their memory stays with the process after
    `free`. Offload and zero.Init exist to keep resident memory low: a fixed threshold makes
    large tensors (a module's whole parameters before zero.Init slices them, the first step's
    optimizer states before they go to disk) return to the OS when freed.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 1 << 20)
