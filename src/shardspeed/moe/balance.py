"""Auxiliary-loss-free load balancing for Hugging Face MoE blocks (the `expert_parallel` section's
`load_balance_coeff`, as DeepSeek-V3 and torchtitan do it).

Each block's router gets a per-expert bias that steers which experts are chosen, and only that:
the gate values stay the model's unbiased ones. After every optimizer step the bias moves by
`coeff * sign(mean load - load)` for each expert, the load being the (token, choice) pairs routed to
it over the accumulation window, summed over the data x sequence-parallel ranks (one all-reduce for all
blocks). An expert that got more than its share becomes less likely to be chosen, one below its
share more likely.

How the bias reaches the choice depends on the router:

- DeepSeek-V3 and GLM-4-MoE routers already choose by `sigmoid scores + e_score_correction_bias`
  and weight by the unbiased scores: the balancer moves that buffer (it is saved with the model).
- Softmax routers that take the top k of the probabilities (Qwen2/Qwen3/Qwen3.5-MoE, Mixtral,
  OLMoE): the router's own output is kept for its logits; the choice is redone as top k of
  `probabilities + bias`, the weights are the probabilities of the chosen experts, renormalised
  where the family renormalises, in the dtype the router returns.
- GPT-OSS, whose router takes the top k of the logits and softmaxes the chosen ones: the choice
  is the top k of `logits + bias`, the weights the softmax of the chosen (unbiased) logits.

With a zero bias each of these returns exactly what the router returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import all_reduce
from ..common.observer import StepObserver
from .rebalance import balanced_slots, move_experts

_CORRECTION = "e_score_correction_bias"


class BiasedSelection:
    """Mixed into a router's class: the model's routing, with `selection_bias` steering which
    experts are chosen (see the module docstring for each kind)."""

    selection_bias: torch.Tensor
    selection_kind: str  # "softmax" (top k of probabilities) or "logits" (top k of logits)
    selection_normalise: bool
    routing_forward: Any  # the router class's own forward (unbound)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, weights, indices = self.routing_forward(self, hidden_states)
        k = indices.shape[-1]
        flat = logits.reshape(-1, logits.shape[-1])
        if self.selection_kind == "logits":
            chosen = torch.topk(flat + self.selection_bias, k, dim=-1).indices
            chosen_weights = torch.softmax(flat.gather(-1, chosen), dim=-1, dtype=flat.dtype)
        else:
            probabilities = torch.softmax(flat, dim=-1, dtype=torch.float32)
            chosen = torch.topk(probabilities + self.selection_bias, k, dim=-1).indices
            chosen_weights = probabilities.gather(-1, chosen)
            if self.selection_normalise:
                chosen_weights = chosen_weights / chosen_weights.sum(dim=-1, keepdim=True)
        return logits, chosen_weights.to(weights.dtype), chosen


_CLASSES: dict[type, type] = {}


def _biased_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Balanced{cls.__name__}", (BiasedSelection, cls), {})
    return _CLASSES[cls]


def routing_bias(router: nn.Module, kind: str, normalise: bool) -> torch.Tensor:
    """The bias that steers `router`'s choice of experts: its own correction bias (kind
    "correction"), or one added to it (kinds "softmax", "logits"; see the module docstring)."""
    if kind == "correction":
        return getattr(router, _CORRECTION)
    count = router.weight.shape[0]
    bias = torch.zeros(count, dtype=torch.float32, device=router.weight.device)
    cls = type(router)
    router.selection_bias, router.selection_kind = bias, kind
    router.selection_normalise, router.routing_forward = normalise, cls.forward
    router.__class__ = _biased_class(cls)
    return bias


class LoadBalancer(StepObserver):
    """After every optimizer step, from the load of the step's training forwards summed over
    `group` (the ranks holding different tokens): moves each block's routing bias by `coeff`
    towards an even load (see the module docstring); names each block's `replicas` most loaded
    experts its `hot_experts` for the next step (`expert_parallel.py`); and every
    `rebalance_every` steps moves the experts between their ranks from the load of those steps
    (`rebalance.py`). `experts[i]` counts the pairs routed by block i; `biases[i]` is its bias
    when `coeff` is set."""

    def __init__(
        self,
        experts: list[nn.Module],
        group: Any,
        coeff: float | None = None,
        biases: list[torch.Tensor] = (),
        replicas: int = 0,
        rebalance_every: int = 0,
    ) -> None:
        self.experts, self.group, self.coeff = experts, group, coeff
        self.biases, self.replicas = list(biases), replicas
        self.rebalance_every, self.steps, self.since = rebalance_every, 0, None

    def after_step(self, engine: Any) -> None:
        windows = [e.take_window_counts() for e in self.experts]
        if any(w is None for w in windows):
            return  # no forward with autograd since the last step
        load = torch.stack(windows).to(torch.float32)
        all_reduce(load, group=self.group)  # every block's load over the ranks with other tokens
        if self.coeff is not None:
            step = self.coeff * torch.sign(load.mean(dim=1, keepdim=True) - load)
            with torch.no_grad():
                for bias, change in zip(self.biases, step):
                    bias.add_(change.to(bias.device, bias.dtype))
        if self.replicas:
            # The same on every rank (the load is summed): ties fall to the lower index.
            hot = torch.sort(torch.topk(load, self.replicas, dim=1, sorted=True).indices).values
            for experts, chosen in zip(self.experts, hot):
                experts.hot_experts = chosen
        if self.rebalance_every:
            self.since = load if self.since is None else self.since + load
            self.steps += 1
            if self.steps % self.rebalance_every == 0:
                for experts, measured in zip(self.experts, self.since):
                    shard = experts.expert_shard
                    slots = balanced_slots(
                        measured, experts.expert_slots, shard.groups.ep_size, shard.local
                    )
                    move_experts(experts, slots, engine.optimizer)
                self.since = None
