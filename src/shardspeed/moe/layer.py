"""DeepSpeed's `MoE` layer: a gate routes each token to k of `num_experts` copies of `expert`, whose
outputs are combined by the gate's weights; `forward` returns (output, l_aux, exp_counts).

Parameters are named as DeepSpeed names them (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.<name>`), so state dicts move between the two, and
expert parameters carry DeepSpeed's marks (`allreduce = False`, `group_name = "ep_size_<n>"`).

Expert parallelism (`ep_size` > 1): each rank of an expert group holds `num_experts / ep_size`
experts. Every rank gates its own tokens, sends each expert's slots to the rank holding it with one
all-to-all, runs its experts on the slots from all ranks, and sends the results back with a second.
The groups come from the engine's topology (`shardspeed.initialize` calls `set_expert_groups`);
the engine's optimizer averages expert gradients over the ranks holding the same experts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..comm import ExpertGroups, all_gather, all_reduce, all_to_all_single
from .gating import GateOutput, TopKGate, imbalance


class Experts(nn.Module):
    """This rank's experts: independent copies of one module (DeepSpeed's `Experts`)."""

    def __init__(self, expert: nn.Module, num_local_experts: int, group_name: str) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            copy.deepcopy(expert) for _ in range(num_local_experts)
        )
        for param in self.deepspeed_experts.parameters():
            # DeepSpeed's marks: not averaged over the whole data-parallel group, and which
            # expert-parallel size's groups average them instead.
            param.allreduce = False
            param.group_name = group_name

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        """[sources, local experts, capacity, model] -> the same shape: local expert i runs on
        `slots[:, i]`, the slots every source rank filled for it."""
        outputs = [e(slots[:, i]) for i, e in enumerate(self.deepspeed_experts)]
        # An expert may return a tuple (a Hugging Face MLP block); its first item is the output.
        return torch.stack([o[0] if isinstance(o, tuple) else o for o in outputs], dim=1)


class _AllToAll(torch.autograd.Function):
    """All-to-all over an expert group; its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, group: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


class MOELayer(nn.Module):
    """Gate, dispatch into [experts, capacity, model] slots, exchange, experts, exchange back,
    combine."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_size = ep_size
        self.num_local_experts = len(experts.deepspeed_experts)
        self.groups: ExpertGroups | None = None
        self.last_gate: GateOutput | None = None  # telemetry of the last forward
        if ep_size > 1:
            gate.capacity_fn = self._agreed_capacity

    def _agreed_capacity(self, local: int) -> int:
        """Without dropping, the busiest expert's count over the expert group: the all-to-all
        needs the same slot count on every rank."""
        need = torch.tensor([local], dtype=torch.int64, device=self.gate.wg.weight.device)
        all_reduce(need, op=torch.distributed.ReduceOp.MAX, group=self._groups().ep_group)
        return int(need)

    def _groups(self) -> ExpertGroups:
        if self.groups is None:
            raise RuntimeError(
                f"this MoE layer has ep_size {self.ep_size} and no expert groups yet: pass the "
                "model to shardspeed.initialize (which makes them from its topology) before "
                "running it"
            )
        return self.groups

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> tuple:
        tokens = hidden.reshape(-1, hidden.shape[-1])
        routed = self.gate(tokens, used_token)
        self.last_gate = routed
        # Each token's choices copy it into their slots (a dropped choice into a spare row past
        # the end), and their slots' outputs come back weighted (0 where dropped): index copies
        # over [tokens, k] rather than products over every (token, expert, slot) triple, and
        # shapes that do not depend on how many choices were kept, so nothing waits on the device.
        model, k = tokens.shape[1], routed.expert_index.shape[1]
        rows = routed.slot_rows.reshape(-1)
        choices = tokens if k == 1 else tokens.repeat_interleave(k, dim=0)
        dispatched = tokens.new_zeros(routed.num_slots + 1, model).index_copy(0, rows, choices)
        dispatched = dispatched[: routed.num_slots]
        # [experts, capacity, model] in expert order is, in rank order, each expert-group rank's
        # [local experts, capacity, model]: one equal chunk per destination.
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(self._groups().ep_group, dispatched)
        slots = dispatched.reshape(self.ep_size, self.num_local_experts, routed.capacity, model)
        expert_output = self.experts(slots)
        if self.ep_size > 1:
            expert_output = _AllToAll.apply(self._groups().ep_group, expert_output)
        # A dropped choice reads the last real row instead of the spare one; its weight is 0.
        returned = expert_output.reshape(-1, model).index_select(
            0, rows.clamp(max=routed.num_slots - 1)
        )
        weights = routed.weight.reshape(-1, 1).type_as(tokens)
        combined = (returned * weights).reshape(-1, k, model).sum(dim=1)
        return combined.reshape(hidden.shape), routed.l_aux, routed.exp_counts


class MoE(nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE` (see the module docstring). Beyond DeepSpeed:
    `temperature` and `load_factors` of the gate (`gating.TopKGate`)."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        temperature: float = 1.0,
        load_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})"
            )
        unsupported = {
            "use_tutel (Tutel's fused kernels)": use_tutel,
            "enable_expert_tensor_parallelism": enable_expert_tensor_parallelism,
        }
        refused = [name for name, asked in unsupported.items() if asked]
        if refused:
            raise NotImplementedError(
                f"MoE({', '.join(refused)}) is not supported: experts run whole on their rank, "
                "with the einsum dispatch"
            )
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.use_residual = use_residual
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
            temperature,
            load_factors,
        )
        self.expert_group_name = f"ep_size_{ep_size}"
        self.deepspeed_moe = MOELayer(
            gate, Experts(expert, self.num_local_experts, self.expert_group_name), ep_size
        )
        if use_residual:
            # Residual MoE: a dense MLP beside the experts, mixed by a learned 2-way softmax.
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_expert_groups(self, groups: ExpertGroups) -> None:
        """Use `groups` (from `Topology.expert_groups(ep_size)`) for the all-to-all exchange."""
        if groups.ep_size != self.ep_size:
            raise ValueError(
                f"groups are for ep_size {groups.ep_size}, this layer has {self.ep_size}"
            )
        self.deepspeed_moe.groups = groups

    def global_expert_index(self, local: int) -> int:
        """Which of the layer's experts local expert `local` is, on this rank."""
        groups = self.deepspeed_moe.groups
        ep_rank = groups.ep_rank if groups is not None else 0
        return ep_rank * self.num_local_experts + local

    def all_experts_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every expert's state (parameters and buffers) under its global index, gathered from
        the expert group (collective over it): what the layer's experts are at ep_size 1."""
        stem = f"{prefix}deepspeed_moe.experts.deepspeed_experts."
        local = self.deepspeed_moe.experts.deepspeed_experts
        if self.ep_size == 1:
            return {
                f"{stem}{i}.{n}": t for i, e in enumerate(local) for n, t in e.state_dict().items()
            }
        group = self.deepspeed_moe._groups().ep_group
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        for i, expert in enumerate(local):
            for name, tensor in expert.state_dict().items():
                parts = [torch.empty_like(tensor) for _ in range(self.ep_size)]
                all_gather(parts, tensor.detach().contiguous(), group=group)
                for r, part in enumerate(parts):
                    gathered.setdefault(r * self.num_local_experts + i, {})[name] = part
        return {f"{stem}{g}.{n}": t for g in sorted(gathered) for n, t in gathered[g].items()}

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> tuple:
        output, l_aux, exp_counts = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mix = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + self.mlp(hidden_states) * mix[..., 1:]
        return output, l_aux, exp_counts

    def expert_load(self) -> dict[str, Any]:
        """The last forward's routing on this rank: tokens asked of each expert (`exp_counts`),
        tokens each got (`tokens_per_expert`), tokens dropped, and the imbalance (busiest expert's
        tokens over the mean). Tensors stay on the device; only `imbalance` syncs."""
        last = self.deepspeed_moe.last_gate
        if last is None:
            return {}
        return {
            "exp_counts": last.exp_counts,
            "tokens_per_expert": last.tokens_per_expert,
            "dropped": last.dropped,
            "imbalance": imbalance(last.tokens_per_expert),
        }
