"""Expert parallelism for the experts of Hugging Face MoE models (transformers' experts interface).

A transformers MoE block routes with its own router, then calls its experts module as
`experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])`; the
experts' weights are fused 3-D tensors whose first dimension is the expert (`gate_up_proj`,
`down_proj`, and GPT-OSS's biases). `shard_experts` keeps, on each rank of an expert group of
`size` ranks, the experts `rank * local ... (rank + 1) * local - 1` of every such tensor (sliced in
place: the same Parameter objects, the same names) and makes the module dropless expert-parallel:

1. each (token, choice) pair is sorted by expert, so the rows for each rank are contiguous;
2. the per-expert counts go to every rank (one all-to-all of `experts` integers), then one host
   read of the split sizes (a variable-split exchange cannot be sized on the device);
3. one all-to-all with those splits sends every row to the rank holding its expert;
4. the rows run through the model's own experts code (its class's forward, or transformers'
   grouped-matmul implementation) on this rank's experts, each row with weight 1;
5. the reverse all-to-all brings the outputs home, where each is weighted by its gate value and
   added into its token in expert order, as the model's own loop adds them.

Under AutoTP (attention tensor-parallel, experts expert-parallel: DeepSpeed's "folding") the
expert groups span tensor-parallel peers, which hold the same tokens: each peer dispatches only
its share of the rows (`scatter_to_row_region`, whose backward joins the shares' gradients, so
the router and the attention before it see whole, replicated gradients), and the outputs are
joined again after the combine (`gather_from_row_region`). Every token then reaches its experts
once, from one peer.

On meta tensors (a dry run, `shardspeed.planning`) the router gives shapes but no values: the
counts of step 2 are then the stated routing's (`stated_routing`: balanced by default, every
expert `pairs / experts` rows), alike on every rank, and the rest runs as it does on a GPU.

Routing is untouched (the block's router runs as it does without EP), so router logits, the
auxiliary loss and shared experts come out as the model returns them. `state_dict()` gives the
experts whole under their own names (gathered over the expert group, so every rank of it calls
it, as with FSDP's full state dict: accelerate's `get_state_dict` and Trainer's `save_model` do),
and `load_state_dict` takes whole tensors and keeps this rank's experts. Backward runs the exchanges
in reverse; each rank's expert gradients then hold its expert group's tokens' share, and the ZeRO
optimizer sums them over the expert-data group and divides by the data-parallel size (see
`placement.py`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import ExpertGroups, ReduceOp, all_reduce, all_to_all_single
from ..tensor_parallel.layers import whole
from ..tensor_parallel.mappings import gather_from_row_region, row_share, scatter_to_row_region
from ..zero.init import materialize
from .gating import imbalance


@dataclass(frozen=True)
class ExpertShard:
    """An experts module's place in its expert group: `local` of `experts` experts, from
    `first`, on rank `groups.ep_rank` of `groups.ep_size`. `token_peers`: the ranks that hold
    the same tokens (tensor-parallel peers) and share the block's rows out among them, or None."""

    experts: int
    local: int
    first: int
    groups: ExpertGroups
    family_forward: Any  # the experts class's own forward (unbound)
    token_peers: Any = None
    check_peers: bool = False  # check the peers' routing agrees (validate_folding_routing)


class _AllToAllRows(torch.autograd.Function):
    """Rows to ranks with split sizes; the gradient goes back with the sizes swapped."""

    @staticmethod
    def forward(
        ctx: Any, group: Any, rows: torch.Tensor, send: list[int], receive: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _AllToAllRows.apply(ctx.group, grad.contiguous(), ctx.receive, ctx.send)
        return None, back, None, None


class ExpertParallel:
    """Mixed into an experts module's class by `shard_experts` (the module keeps its class's
    code, parameter names and `isinstance` answers; FSDP2's `fully_shard` does the same)."""

    expert_shard: ExpertShard

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        shard = self.expert_shard
        counts = _rows_per_expert(top_k_index, shard.experts)
        self.last_counts = counts.detach()  # the routing this rank asked for (`expert_load`)
        if torch.is_grad_enabled():  # a training forward: its load counts for balancing
            window = getattr(self, "window_counts", None)
            self.window_counts = self.last_counts if window is None else window + counts
        if shard.groups.ep_size == 1:
            return shard.family_forward(self, hidden_states, top_k_index, top_k_weights)
        peers = shard.token_peers
        if peers is None:
            return self._dispatch(hidden_states, top_k_index, top_k_weights, counts)
        # Tensor-parallel peers hold the same tokens: each sends its share of the rows, and
        # the outputs are joined again for the replicated work after the block.
        if shard.check_peers:
            _check_same_routing(top_k_index, top_k_weights, peers)
        total = hidden_states.shape[0]
        index = top_k_index[row_share(total, peers)]
        out = self._dispatch(
            scatter_to_row_region(hidden_states, peers),
            index,
            scatter_to_row_region(top_k_weights, peers),
            _rows_per_expert(index, shard.experts),
        )
        return gather_from_row_region(out, total, peers)

    def _dispatch(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """The rows to their experts' ranks and back (steps 1-5 of the module docstring); rows
        of hot experts (`hot_experts`, copied here for the step) stay and run here."""
        shard = self.expert_shard
        flat = top_k_index.reshape(-1)
        choices = top_k_index.shape[-1]
        size, local = shard.groups.ep_size, shard.local
        group = shard.groups.ep_group
        hot = getattr(self, "hot_experts", None)
        copies: dict[str, torch.Tensor] = {}
        placed = self.slot_of()
        key = flat if placed is None else placed[flat]  # rows go by the slot holding the expert
        if placed is not None and hot is None:
            counts = torch.bincount(key, minlength=shard.experts)
        if hot is not None:
            # Hot experts sort after every other, by their place in `hot`: the rows sent away
            # come first, this rank's hot rows last.
            slot = torch.full((shard.experts,), -1, dtype=torch.long, device=flat.device)
            slot[hot] = torch.arange(hot.numel(), device=flat.device)
            key = torch.where(slot[flat] >= 0, shard.experts + slot[flat], key)
            every = torch.bincount(key, minlength=shard.experts + hot.numel())
            counts, hot_counts = every[: shard.experts], every[shard.experts :]
            copies = _hot_copies(self, hot, group)
        order = torch.argsort(key, stable=True)
        token = order // choices  # pair p is token p // k's choice p % k
        received = torch.empty_like(counts)
        all_to_all_single(received, counts, group=group)  # [source rank, local expert]
        if flat.is_meta:  # a dry run: every rank routes by the stated routing, as this one
            received = counts.view(size, local)[shard.groups.ep_rank].repeat(size)
        sizes = torch.stack([counts.view(size, local).sum(1), received.view(size, local).sum(1)])
        send, receive = sizes.tolist()
        rows = hidden_states.index_select(0, token)
        sent = sum(send)
        rows = _AllToAllRows.apply(group, rows[:sent], send, receive), rows[sent:]
        local_expert = torch.arange(local, device=received.device).repeat(size)
        local_expert = local_expert.repeat_interleave(received).to(flat.device)
        if copies:  # the hot rows run as experts local, local + 1, ... after this rank's own
            hot_expert = local + torch.arange(hot.numel(), device=flat.device)
            local_expert = torch.cat([local_expert, hot_expert.repeat_interleave(hot_counts)])
        computed = torch.cat(rows) if copies else rows[0]
        self.last_rows = computed.new_tensor(computed.shape[0], dtype=torch.long)
        ones = torch.ones(computed.shape[0], 1, dtype=top_k_weights.dtype, device=flat.device)
        module = _with_experts(self, copies) if copies else self
        out = shard.family_forward(module, computed, local_expert.unsqueeze(1), ones)
        back = _AllToAllRows.apply(group, out[: rows[0].shape[0]], receive, send)
        if copies:
            back = torch.cat([back, out[rows[0].shape[0] :]])
        weighted = back * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(1)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add_(0, token, weighted.to(combined.dtype))

    def slot_of(self) -> torch.Tensor | None:
        """Each expert's global slot (rank * local + row) when the experts were moved from their
        own places (`place_slots`), else None."""
        return self.moved_slot_of

    def place_slots(self, slots: torch.Tensor) -> None:
        """Record that global slot s now holds expert `slots[s]` (the data moved already)."""
        self.expert_slots = slots.clone()
        # Once per move, not per step; on meta tensors (a dry run) the experts stay home.
        home = slots.is_meta or torch.equal(slots.cpu(), torch.arange(slots.numel()))
        self.moved_slot_of = None if home else torch.argsort(self.expert_slots)

    def take_window_counts(self) -> torch.Tensor | None:
        """The pairs routed to each expert by training forwards since the last call (None if
        none ran), and a fresh window."""
        window = getattr(self, "window_counts", None)
        self.window_counts = None
        return window

    def expert_load(self) -> dict[str, Any]:
        """The last forward's routing on this rank, as `MoE.expert_load` reports it (nothing is
        dropped), and the rows this rank computed (`rows_computed`: what it received, with its
        hot experts' rows): tensors stay on the device; only `imbalance` syncs."""
        counts = getattr(self, "last_counts", None)
        if counts is None:
            return {}
        load = {
            "exp_counts": counts,
            "tokens_per_expert": counts,
            "dropped": counts.new_zeros(()),
            "imbalance": imbalance(counts),
        }
        if hasattr(self, "last_rows"):  # rows this rank's experts (and hot copies) computed
            load["rows_computed"] = self.last_rows
        return load


def balanced_routing(pairs: int, experts: int) -> torch.Tensor:
    """Rows per expert when each of `experts` gets `pairs / experts` of a block's (token, choice)
    pairs (the first ones one more where they do not divide)."""
    counts = torch.full((experts,), pairs // experts, dtype=torch.long)
    counts[: pairs % experts] += 1
    return counts


# The routing a dry run states (`shardspeed.planning`): meta tensors carry no router values, so
# each block's rows per expert come from this, on every rank alike, from (pairs, experts).
stated_routing = balanced_routing


def _rows_per_expert(top_k_index: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of the (token, choice) pairs chose each expert: counted, or on meta tensors the
    stated routing's, on the host (the split sizes it gives are read there anyway)."""
    if top_k_index.is_meta:
        return stated_routing(top_k_index.numel(), experts)
    return torch.bincount(top_k_index.reshape(-1), minlength=experts)


def _check_same_routing(index: torch.Tensor, weights: torch.Tensor, peers: Any) -> None:
    """Raise unless every tensor-parallel peer chose the same experts with the same weights."""
    mine = torch.cat([index.reshape(-1).to(torch.float64), weights.detach().reshape(-1).double()])
    low, high = mine.clone(), mine.clone()
    all_reduce(low, op=ReduceOp.MIN, group=peers)
    all_reduce(high, op=ReduceOp.MAX, group=peers)
    if not torch.equal(low, high):
        raise RuntimeError(
            "'expert_parallel.validate_folding_routing': tensor-parallel peers routed their "
            "tokens differently (they hold the same tokens and must agree): check that the peers "
            "get the same batch and that nothing random (router jitter, dropout before the "
            "router) differs between them"
        )


class _SumOverGroup(torch.autograd.Function):
    """Every rank's tensor summed, on every rank; each rank's result feeds its own work, so
    the gradient of each part is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        all_reduce(grad, group=ctx.group)
        return grad, None


def _hot_copies(module: nn.Module, hot: torch.Tensor, group: Any) -> dict[str, torch.Tensor]:
    """Each expert tensor's rows for the `hot` experts, on every rank of the expert group: the
    rank holding each writes it and one all-reduce per tensor shares them (its backward sums the
    copies' gradients back into the holder's rows)."""
    shard: ExpertShard = module.expert_shard
    placed = module.slot_of()
    slot = hot if placed is None else placed[hot]
    here = (slot >= shard.first) & (slot < shard.first + shard.local)
    rows = (slot - shard.first).clamp(0, shard.local - 1)
    copies = {}
    for name, param in expert_tensors(module):
        mask = here.to(param.dtype).view(-1, *([1] * (param.dim() - 1)))
        copies[name] = _SumOverGroup.apply(param.index_select(0, rows) * mask, group)
    return copies


def _with_experts(module: nn.Module, copies: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow stand-in for `module` whose expert tensors are its own followed by `copies`,
    for the family's expert code to run both at once."""
    proxy = copy.copy(module)
    tensors = dict(expert_tensors(module))
    proxy.__dict__["_parameters"] = {
        name: torch.cat([tensors[name], copies[name]]) for name in tensors
    }
    proxy.num_experts = module.num_experts + next(iter(copies.values())).shape[0]
    return proxy


def expert_tensors(experts: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The experts module's own parameters (all of them per expert, on the first dimension)."""
    return list(experts.named_parameters(recurse=False))


def shard_experts(
    experts: nn.Module,
    groups: ExpertGroups,
    implementation: str | None,
    token_peers: Any = None,
    check_peers: bool = False,
) -> None:
    """Make `experts` (a transformers experts module of E experts) expert-parallel over `groups`:
    keep this rank's E / ep_size experts of each tensor, in place, and dispatch as the module
    docstring says. `implementation`: transformers' experts implementation for the local experts
    ("grouped_mm", "eager"), or None to keep the model's. `token_peers`: the group of ranks
    holding the same tokens (tensor-parallel peers, whose expert groups span them), which each
    dispatch only their share of the rows; `check_peers`: check at each forward that they routed
    alike."""
    tensors = expert_tensors(experts)
    materialize([p for _, p in tensors])  # built under zero.Init: whole again, then sliced
    count = tensors[0][1].shape[0]
    local = count // groups.ep_size
    first = groups.ep_rank * local
    cls = type(experts)
    for _, param in tensors:
        # The same Parameter object: an optimizer the script built over the model keeps it.
        param.data = param.data[first : first + local].clone()
        param.allreduce = False  # DeepSpeed's marks of an expert parameter
        param.group_name = f"ep_size_{groups.ep_size}"
    experts.num_experts = local
    if implementation is not None and hasattr(experts, "config"):
        experts.config = copy.copy(experts.config)  # this module's own choice, not the model's
        experts.config._experts_implementation = implementation
    experts.expert_shard = ExpertShard(
        count, local, first, groups, cls.forward, token_peers, check_peers
    )
    experts.__class__ = _expert_parallel_class(cls)
    # Which expert each global slot holds: its own at first (moe/rebalance.py moves them).
    experts.place_slots(torch.arange(count, device=tensors[0][1].device))
    if groups.ep_size > 1:
        experts.register_state_dict_post_hook(_whole_experts)
        experts.register_load_state_dict_pre_hook(_local_experts)


def _whole_experts(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: this rank's run of experts becomes all of them (collective over the
    expert group). Left alone: `keep_vars=True` (the engine's own readers, which want the live
    Parameters) and ZeRO-3's empty shards outside a gather (as DeepSpeed gives them)."""
    shard: ExpertShard = module.expert_shard
    for name, _ in expert_tensors(module):
        key = prefix + name
        tensor = state.get(key)
        if isinstance(tensor, nn.Parameter) or tensor is None or tensor.shape[0] != shard.local:
            continue
        state[key] = home_order(module, whole(tensor, 0, shard.groups.ep_group))


def _local_experts(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    """Load hook: a whole experts tensor (every expert, as `state_dict()` and the Hugging Face
    files hold them) is cut to this rank's run; this rank's run itself loads as it is."""
    shard: ExpertShard = module.expert_shard
    for name, _ in expert_tensors(module):
        tensor = state.get(prefix + name)
        if tensor is not None and tensor.shape[0] == shard.experts:
            mine = module.expert_slots[shard.first : shard.first + shard.local]
            state[prefix + name] = tensor.index_select(0, mine.to(tensor.device))


def home_order(module: nn.Module, gathered: torch.Tensor) -> torch.Tensor:
    """An experts tensor gathered over the expert group (slot order) in the experts' own order."""
    placed = module.slot_of()
    return gathered if placed is None else gathered.index_select(0, placed.to(gathered.device))


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """One mixed class per experts class (copies of the module share it)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    return _CLASSES[cls]
