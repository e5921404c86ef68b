"""Moving experts between the ranks of their expert group from measured load (the `expert_parallel`
section's `rebalance_interval`).

An expert-parallel experts module holds E / ep experts per rank in `local` rows. Its
`expert_slots` say which expert each global slot (rank * local + row) holds; at the start, expert
s in slot s. A new placement only permutes the experts of each row position among the ranks (an
expert at row i moves to row i of another rank). That keeps every per-element buffer aligned: the
weights, the fp32 masters and the optimizer states sit at the same positions on every rank of the
expert group (their ZeRO shards too: the expert group's ranks share one expert-data rank), so a
move is one all-gather over the expert group per tensor and a pick of each row from its new source
rank.

`balanced_slots` chooses the permutation: row positions in order of their hottest expert, each
row's experts placed hottest first on the rank with the least load so far that has none of that
row yet (longest processing time first, one expert per rank and row). Checkpoints see the experts
in their own order: the engine moves them home around a save and before a load (`ExpertPlacement`),
and the state-dict hooks and consolidation reorder what they gather (`expert_parallel.home_order`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import all_gather_into_tensor
from .expert_parallel import ExpertParallel, expert_tensors


def balanced_slots(load: torch.Tensor, slots: torch.Tensor, ep: int, local: int) -> torch.Tensor:
    """A placement of the experts in `slots` (the expert in each global slot) that evens the
    ranks' summed `load` (per expert), moving experts only between ranks at one row position."""
    load = load.detach().double().cpu()
    grid = slots.cpu().view(ep, local)  # [rank, row] -> expert
    placed = grid.clone()
    rank_load = torch.zeros(ep, dtype=torch.float64)
    for row in torch.argsort(load[grid].amax(0), descending=True, stable=True).tolist():
        free = torch.ones(ep, dtype=torch.bool)
        column = grid[:, row]
        for expert in column[torch.argsort(load[column], descending=True, stable=True)].tolist():
            rank = int(torch.argmin(torch.where(free, rank_load, float("inf"))))
            placed[rank, row] = expert
            rank_load[rank] += load[expert]
            free[rank] = False
    return placed.reshape(-1).to(slots.device)


def move_experts(module: ExpertParallel, slots: torch.Tensor, optimizer: Any) -> None:
    """Move `module`'s experts to the placement `slots` (collective over its expert group): its
    weights, and the fp32 masters and optimizer states `optimizer` (the engine's ZeRO optimizer,
    stages 0-2, states in memory) holds for them."""
    shard = module.expert_shard
    before = module.expert_slots
    if torch.equal(slots, before):
        return
    local, ep, rank = shard.local, shard.groups.ep_size, shard.groups.ep_rank
    slot_before = torch.argsort(before)  # expert -> its slot now
    wanted = slots[rank * local : (rank + 1) * local]  # the expert each of my rows will hold
    source_slot = slot_before[wanted]
    if not torch.equal(source_slot % local, torch.arange(local, device=slots.device)):
        raise ValueError("a placement may move an expert only to the same row of another rank")
    source = (source_slot // local).cpu()  # per row: the rank it comes from
    for tensor, rows in _per_element_tensors(module, optimizer):
        _take_rows(tensor, rows, source, shard.groups.ep_group, ep)
    module.place_slots(slots)


def _per_element_tensors(module: nn.Module, optimizer: Any) -> list[tuple[torch.Tensor, Any]]:
    """Every flat tensor that holds values of `module`'s expert tensors element by element, each
    with the row (local expert) of each of its elements: the weights themselves, then each
    fragment of their masters and of the masters' optimizer states. A master that is the weight's
    own storage (an fp32 model) is left to the weight."""
    out: list[tuple[torch.Tensor, Any]] = []
    plan = optimizer.plan
    index = {p: i for i, p in enumerate(plan.params)}
    for _, param in expert_tensors(module):
        row_size = param[0].numel()
        out.append((param.data.view(-1), torch.arange(param.numel()) // row_size))
        if param not in index:
            continue
        storage = param.untyped_storage().data_ptr()
        for k, start, offset, length in plan.fragments(index[param]):
            master = optimizer.masters[k]
            rows = (start + torch.arange(length)) // row_size
            if master.untyped_storage().data_ptr() != storage:
                out.append((master.data.view(-1).narrow(0, offset, length), rows))
            for value in optimizer.optimizer.state.get(master, {}).values():
                if torch.is_tensor(value) and value.numel() == master.numel() > 1:
                    out.append((value.view(-1).narrow(0, offset, length), rows))
    return out


def _take_rows(
    tensor: torch.Tensor, rows: torch.Tensor, source: torch.Tensor, group: Any, ep: int
) -> None:
    """`tensor` (a flat view) takes each element from the rank its row's new expert comes from."""
    gathered = tensor.new_empty(ep * tensor.numel())
    all_gather_into_tensor(gathered, tensor.contiguous(), group=group)
    gathered = gathered.view(ep, tensor.numel())
    pick = source[rows].to(tensor.device).unsqueeze(0)
    tensor.copy_(gathered.gather(0, pick).squeeze(0))
