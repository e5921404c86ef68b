"""The bytes a rank holds for its model state, by kind and by where they live."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states", "buffers")


def memory_breakdown(
    optimizer: Any, module: nn.Module, device: torch.device, untrained: Sequence[Any] = ()
) -> dict[str, int]:
    """Bytes this rank holds, by kind, each storage counted once (views share their storage).

    `optimizer` is the engine's ZeroOptimizer (None: the module's parameters only); `untrained`:
    stage 3's shards of the parameters it does not step (`zero.stores.shard_untrained`). `on_device`,
    `on_cpu` and `on_nvme` split the same bytes by where they live (swap files counted at their
    size on disk); "device" is `device`'s memory (host memory when there is no accelerator). At
    stage 3 `gathered_peak` adds the most bytes of gathered parameters alive at one time.
    """
    places = memory_places(optimizer, module, device, untrained)
    sizes = {kind: sum(where.values()) for kind, where in places.items()}
    sizes["total"] = sum(sizes.values())
    swapped = getattr(optimizer, "swapped", None)
    sizes.update(
        {f"on_{place}": sum(where[place] for where in places.values()) for place in _PLACES}
    )
    sizes["on_nvme"] = swapped.bytes_on_disk() if swapped is not None else 0
    sharded = [getattr(optimizer, "sharded_params", None), *(s.sharded_params for s in untrained)]
    sharded = [s for s in sharded if s is not None]
    if sharded:
        # The most bytes of whole (gathered) parameters alive at once so far, which comes on
        # top of what is held between steps (with untrained shards: the sum of each set's peak,
        # a bound, since their peaks may not coincide).
        sizes["gathered_peak"] = sum(s.peak_gathered_bytes for s in sharded)
    return sizes


_PLACES = ("device", "cpu")


def memory_places(
    optimizer: Any, module: nn.Module, device: torch.device, untrained: Sequence[Any] = ()
) -> dict[str, dict[str, int]]:
    """Bytes this rank holds in memory, by kind and by place ("device": `device`'s memory, host
    memory when there is no accelerator; "cpu": host memory beside an accelerator), each storage
    counted once. Swap files are not in it (`optimizer.swapped.bytes_on_disk()`)."""
    held = (
        optimizer.held_tensors()
        if optimizer is not None
        else {"parameters": list(module.parameters())}
    )
    held["parameters"] += [t for store in untrained for t in store.tensors()]
    held["buffers"] = list(module.buffers())
    seen: set[tuple] = set()
    accelerator = device.type != "cpu"
    # What the config offloads, by storage: in a dry run it is on the meta device like the rest.
    offloaded = optimizer.host_tensors() if optimizer is not None else []
    offloaded += [
        t for s in untrained if s.shard_offloaded for t in s.sharded_params.store.tensors()
    ]
    host = {storage_key(t) for t in offloaded} if accelerator else set()
    places = {}
    for kind in _KINDS:
        where = dict.fromkeys(_PLACES, 0)
        for tensor in held.get(kind, []):
            key = storage_key(tensor)
            nbytes = tensor.untyped_storage().nbytes()
            if nbytes and key not in seen:
                seen.add(key)
                on_host = (accelerator and tensor.device.type == "cpu") or key in host
                where["cpu" if on_host else "device"] += nbytes
        places[kind] = where
    return places


def storage_key(tensor: torch.Tensor) -> tuple:
    """What identifies `tensor`'s storage, shared by its views. Meta tensors (a dry run) have no
    addresses, so there the storage object itself tells them apart."""
    storage = tensor.untyped_storage()
    if tensor.is_meta:
        return (storage._cdata, tensor.device)
    return (storage.data_ptr(), tensor.device)


# Autograd nodes of views: a tensor reached from a leaf through these alone is that leaf's memory.
_VIEW_NODES = frozenset(
    f"{name}Backward0"
    for name in ("T", "View", "UnsafeView", "Transpose", "Permute", "Expand", "Alias", "AsStrided",
                 "Slice", "Select", "Unsqueeze", "Squeeze", "Reshape")
)  # fmt: skip


def _viewed_leaf(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a trained parameter (a leaf that is an `nn.Parameter`) or a view of
    one. Other leaves that require grad are activations: a later pipeline stage's input."""
    node = tensor.grad_fn
    if node is None:
        return tensor.requires_grad and isinstance(tensor, nn.Parameter)
    while type(node).__name__ in _VIEW_NODES:
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return type(node).__name__ == "AccumulateGrad" and isinstance(node.variable, nn.Parameter)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` start at the same place of the same storage (on the meta device, where
    every address is 0, by storage and offset)."""
    if a.is_meta or b.is_meta:
        return storage_key(a) == storage_key(b) and a.storage_offset() == b.storage_offset()
    return a.data_ptr() == b.data_ptr()


@contextmanager
def saved_activation_bytes(module: nn.Module) -> Iterator[list[int]]:
    """Count the bytes autograd keeps for backward while the block runs (each storage once,
    `module`'s parameters and views of them not counted, such as the transposed weight a linear
    layer keeps, whether it lives in a flat buffer or is gathered by ZeRO-3): the activations of a
    forward pass. Yields a one-element
    list that holds the count when the block ends. Activation checkpointing keeps less, and the
    count shows it: only what is really saved is counted. The counted tensors are held until the
    block ends: a block with backward passes inside (a pipeline's window of micro-batches) frees
    storages, and a later tensor at a freed one's address would be taken for it."""
    parameters = {id(p) for p in module.parameters()}
    seen: set[tuple] = set()
    held: list[torch.Tensor] = []
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        nbytes = tensor.untyped_storage().nbytes()
        weight = id(tensor) in parameters or _viewed_leaf(tensor)
        if not weight and key not in seen and nbytes:
            seen.add(key)
            held.append(tensor)
            total[0] += nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
