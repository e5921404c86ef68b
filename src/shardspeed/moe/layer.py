"""DeepSpeed's `MoE` layer: a gate routes each token to k of `num_experts` copies of `expert`, whose
outputs are combined by the gate's weights; `forward` returns (output, l_aux, exp_counts).

Parameters are named as DeepSpeed names them (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.<name>`), so state dicts move between the two.
Expert parallelism (`ep_size` > 1: experts spread over ranks, tokens exchanged all-to-all, expert
gradients averaged over the expert-data group) is refused until the optimizer shards expert state
over that group (the rest of issue 9).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .gating import GateOutput, TopKGate


class Experts(nn.Module):
    """This rank's experts: independent copies of one module (DeepSpeed's `Experts`)."""

    def __init__(self, expert: nn.Module, num_local_experts: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            copy.deepcopy(expert) for _ in range(num_local_experts)
        )

    def forward(self, dispatched: torch.Tensor) -> torch.Tensor:
        """[experts, capacity, model] -> the same shape, each expert on its own slots."""
        return torch.stack([e(x) for e, x in zip(self.deepspeed_experts, dispatched)])


class MOELayer(nn.Module):
    """Gate, dispatch into [experts, capacity, model] slots, experts, combine."""

    def __init__(self, gate: TopKGate, experts: Experts) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.last_gate: GateOutput | None = None  # telemetry of the last forward

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> tuple:
        tokens = hidden.reshape(-1, hidden.shape[-1])
        routed = self.gate(tokens, used_token)
        self.last_gate = routed
        dispatched = torch.einsum("sec,sm->ecm", routed.dispatch_mask.type_as(tokens), tokens)
        combined = torch.einsum(
            "sec,ecm->sm", routed.combine_weights.type_as(tokens), self.experts(dispatched)
        )
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
            "ep_size > 1 (expert parallelism)": ep_size > 1,
            "use_tutel": use_tutel,
            "enable_expert_tensor_parallelism": enable_expert_tensor_parallelism,
        }
        refused = [name for name, asked in unsupported.items() if asked]
        if refused:
            raise NotImplementedError(
                f"MoE({', '.join(refused)}) is not supported yet (issue 9): experts run on every "
                "rank, averaged with the other parameters"
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
        self.deepspeed_moe = MOELayer(gate, Experts(expert, self.num_local_experts))
        if use_residual:
            # Residual MoE: a dense MLP beside the experts, mixed by a learned 2-way softmax.
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> tuple:
        output, l_aux, exp_counts = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mix = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + self.mlp(hidden_states) * mix[..., 1:]
        return output, l_aux, exp_counts

    def expert_load(self) -> dict[str, Any]:
        """The last forward's routing: tokens asked of each expert, tokens each got, dropped."""
        last = self.deepspeed_moe.last_gate
        if last is None:
            return {}
        return {
            "exp_counts": last.exp_counts,
            "tokens_per_expert": last.tokens_per_expert,
            "dropped": last.dropped,
        }
