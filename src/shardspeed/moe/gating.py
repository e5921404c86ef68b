"""The gate of a mixture-of-experts layer: which tokens go to which expert, in which slot of the
expert's fixed-size buffer, and with what weight their expert output is mixed back in
(DeepSpeed's `TopKGate` with its `top1gating` / `top2gating`).

Everything here runs in one process on this rank's tokens and communicates nothing. The all-to-all
that moves tokens to experts, and the all-reduce that makes every rank of an expert group agree on
the capacity when no tokens are dropped, belong to the MoE layer; the gate takes the latter as a
callable (`capacity_fn`) so that it stays free of process groups.

Each expert takes at most `capacity` tokens, so all-to-all buffers have a fixed shape. A gate's
answer is two [tokens, experts, capacity] tensors: `dispatch_mask` says which token fills which
slot, and `combine_weights` holds the weight with which that slot's expert output comes back to its
token. The gate computes in fp32 whatever the input dtype, as DeepSpeed does, because softmax and
the load-balancing loss lose too much in half precision.

Where this gate differs from DeepSpeed 0.19.8 (each is noted where it happens):
- `capacity` uses exact arithmetic on the capacity factor as written, where DeepSpeed rounds in
  fp32 (25 tokens, 1 expert, factor 1.2: 30 slots here, 31 in DeepSpeed).
- top-1 without random token selection keeps tokens in position order; DeepSpeed's choice there
  falls out of `torch.topk`'s tie-breaking (on CPU it kept the last tokens, not the first).
- top-2 honours `used_token` (DeepSpeed ignores it for k=2) and samples the second expert only
  in training (DeepSpeed samples in eval too, which makes evaluation random).
- `temperature` and `load_factors` are additions; their defaults reproduce DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GateOutput", "TopKGate", "capacity", "imbalance"]

# Half-width of DeepSpeed's multiplicative input jitter (the Switch Transformer's value).
JITTER_EPSILON = 1e-2
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: `max(ceil(num_tokens / num_experts * capacity_factor), min_capacity)`.

    Top-2 callers pass twice their capacity factor, as DeepSpeed does, since every token makes two
    assignments. The factor is taken as the decimal it prints as, so that a product the user means
    to be whole is not pushed up a slot by binary rounding.
    """
    exact = Fraction(num_tokens) * Fraction(repr(float(capacity_factor))) / num_experts
    return max(math.ceil(exact), min_capacity)


def imbalance(exp_counts: torch.Tensor) -> float:
    """Load of the busiest expert over the mean load (1.0 is perfect balance).

    A batch that routed no tokens counts as balanced, so a monitor never logs NaN.
    """
    mean = exp_counts.float().mean().item()
    return exp_counts.max().item() / mean if mean > 0 else 1.0


@dataclass
class GateOutput:
    """What a gate decided for one batch of tokens.

    The decision is kept per token and choice, [tokens, k] (`expert_index`, `slot_index`, `kept`,
    `weight`): fixed shapes, so that routing with a fixed capacity never waits for the device to
    say how many assignments survived. The MoE layer dispatches with `slot_rows`; the dense
    [tokens, experts, capacity] tensors DeepSpeed's gate returns (`combine_weights`,
    `dispatch_mask`) are built from it on request. `exp_counts` is the demand (what the router
    asked of each expert, before capacity dropped anything, as DeepSpeed reports it);
    `tokens_per_expert` and `dropped` are what capacity let through, for telemetry.
    """

    l_aux: torch.Tensor
    """Scalar load-balancing loss, to be added (scaled) to the training loss."""
    num_tokens: int
    capacity: int
    """Slots per expert."""
    expert_index: torch.Tensor
    """int64 [tokens, k]: each token's chosen experts."""
    slot_index: torch.Tensor
    """int64 [tokens, k]: the slot a kept choice takes in its expert's buffer (meaningless where
    not kept)."""
    kept: torch.Tensor
    """bool [tokens, k]: whether the choice got a slot (False for dropped and padding tokens)."""
    weight: torch.Tensor
    """fp32 [tokens, k]: the weight the choice's expert output comes back with, 0 where not kept
    (differentiable)."""
    exp_counts: torch.Tensor
    """int64 [experts]: token-expert assignments per expert before capacity dropping."""
    dropped: torch.Tensor
    """Token-expert assignments dropped because their expert was full (a 0-dim tensor: reading
    it is the caller's host sync, not the gate's)."""
    tokens_per_expert: torch.Tensor
    """int64 [experts]: assignments each expert actually receives."""

    @property
    def num_slots(self) -> int:
        """Slots of all experts together: rows of the [experts * capacity, model] dispatch buffer."""
        return self.exp_counts.numel() * self.capacity

    @property
    def slot_rows(self) -> torch.Tensor:
        """int64 [tokens, k]: each choice's row of the dispatch buffer, `num_slots` (one spare row
        past the end) where it was not kept."""
        rows = self.expert_index * self.capacity + self.slot_index
        return torch.where(self.kept, rows, self.num_slots)

    def _dense(self, values: torch.Tensor) -> torch.Tensor:
        """[tokens, experts, capacity] holding `values` [tokens, k] at the kept choices' slots."""
        dense = values.new_zeros(self.num_tokens, self.num_slots + 1)
        dense.scatter_(1, self.slot_rows, values)
        return dense[:, : self.num_slots].reshape(self.num_tokens, -1, self.capacity)

    @property
    def combine_weights(self) -> torch.Tensor:
        """fp32 [tokens, experts, capacity]: weight of each slot's expert output for each token."""
        return self._dense(self.weight)

    @property
    def dispatch_mask(self) -> torch.Tensor:
        """bool [tokens, experts, capacity]: which token fills which slot of which expert."""
        return self._dense(self.kept)


class TopKGate(nn.Module):
    """A linear router (`wg`, no bias) that sends each token to its top-1 or top-2 experts.

    Arguments as DeepSpeed's `TopKGate`, except that `k` must be 1 or 2 and there is no
    `ep_group` (see `capacity_fn`):
        model_dim, num_experts: width of the tokens, number of experts (all ranks together).
        k: experts per token.
        capacity_factor, eval_capacity_factor: slots per expert relative to an even split of the
            tokens, in training and in eval mode.
        min_capacity: fewest slots per expert when dropping tokens.
        noisy_gate_policy: None/"None"; "Jitter" multiplies the input by uniform noise in
            [1 - 1e-2, 1 + 1e-2]; "RSample" adds Gumbel noise to the logits that pick the top-1
            expert (not to the gate values). Both apply in training only; "RSample" has no effect
            with k=2, whose noise is `top2_2nd_expert_sampling`, as in DeepSpeed.
        drop_tokens: False sizes the buffers for the busiest expert, so nothing is dropped.
        use_rts: random token selection (top-1): an over-full expert keeps a uniformly random
            subset of its tokens rather than the first ones, so the end of a batch is not the part
            that always loses. It applies in eval mode too and to top-1 only; top-2 drops in
            position order, both as in DeepSpeed.
        top2_2nd_expert_sampling: pick the second expert by sampling from the gate distribution
            (Gumbel-max) in training, rather than taking the runner-up.
        temperature: the logits are divided by it before the softmax; below 1 sharpens the gate
            values, above 1 flattens them, and noisy choices sample from the tempered
            distribution. Without noise it never changes which experts are picked.
        load_factors: optional [num_experts] penalties, see `set_load_factors`.
        capacity_fn: with drop_tokens=False, called with this rank's busiest expert count and
            returning the capacity to use. The MoE layer passes an all-reduce of the maximum over
            its expert group here, since every rank's buffers must have the same shape for the
            all-to-all. It must not return less than it was given.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        temperature: float = 1.0,
        load_factors: torch.Tensor | None = None,
        capacity_fn: Callable[[int], int] | None = None,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"k={k}: the gate routes each token to 1 or 2 experts")
        if k > num_experts:
            raise ValueError(f"k={k} needs at least {k} experts, got num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r}: expected one of {NOISY_GATE_POLICIES}"
            )
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: must be positive")
        if capacity_factor <= 0 or eval_capacity_factor <= 0 or min_capacity < 0:
            raise ValueError(
                "capacity_factor and eval_capacity_factor must be positive and min_capacity "
                f"non-negative, got {capacity_factor}, {eval_capacity_factor}, {min_capacity}"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.temperature = temperature
        self.capacity_fn = capacity_fn
        # Not persistent: it is a controller's current output rather than a learned value, and a
        # state_dict key DeepSpeed's gate lacks would break loading checkpoints in either direction.
        self.register_buffer("load_factors", None, persistent=False)
        self.set_load_factors(load_factors)

    def set_load_factors(self, load_factors: torch.Tensor | None) -> None:
        """Penalise experts by `load_factors` ([num_experts], >= 0; None removes them).

        The penalty is subtracted from the (tempered) logits that choose experts, that is it
        divides an expert's unnormalised routing probability by exp(factor): 0 is no penalty, and
        one unit costs an expert the same share of tokens whatever the other logits are. This is
        the bias of auxiliary-loss-free balancing (DeepSeek-V3), so a controller can raise an
        overloaded expert's factor by a step each batch. A log-ratio penalty would make 0 mean
        "forbidden" and need clamping. The factors only steer the choice: gate values in
        `combine_weights` and `l_aux` come from the unbiased softmax, so the penalty does not
        distort the mixture of outputs or the loss's gradient.
        """
        if load_factors is None:
            self.load_factors = None
            return
        factors = torch.as_tensor(load_factors, dtype=torch.float32, device=self.wg.weight.device)
        if factors.shape != (self.num_experts,):
            raise ValueError(
                f"load_factors has shape {tuple(factors.shape)}, expected ({self.num_experts},)"
            )
        if not (torch.isfinite(factors).all() and (factors >= 0).all()):
            raise ValueError("load_factors must be finite and non-negative")
        self.load_factors = factors.detach().clone()

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> GateOutput:
        """Route `input` [tokens, model_dim]; `used_token` [tokens] (nonzero = real token) keeps
        padding out of every expert and out of the counts."""
        if input.dim() != 2:
            raise ValueError(f"input must be [tokens, model_dim], got {tuple(input.shape)}")
        num_tokens = input.shape[0]
        used = None
        if used_token is not None:
            if used_token.numel() != num_tokens:
                raise ValueError(
                    f"used_token has {used_token.numel()} entries for {num_tokens} tokens"
                )
            used = used_token.reshape(num_tokens, 1).bool()

        x = input.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            x = x * (torch.rand_like(x) * (2 * JITTER_EPSILON) + (1 - JITTER_EPSILON))
        logits = F.linear(x, self.wg.weight.float()) / self.temperature
        gates = logits.softmax(dim=1)
        routing = logits.detach()
        if self.load_factors is not None:
            routing = routing - self.load_factors

        route = self._top1 if self.k == 1 else self._top2
        first, assigned, kept, slots, weights, slots_per_expert, choices = route(
            routing, gates, used
        )

        # Load-balancing loss of Switch/GShard on the first choices before dropping; the means run
        # over all tokens, padding included, as in DeepSpeed (whose top-2 form, mean * E * E, is the
        # same quantity).
        l_aux = self.num_experts * (gates.mean(dim=0) * first.float().mean(dim=0)).sum()

        exp_counts = assigned.sum(dim=0)
        tokens_per_expert = kept.sum(dim=0)
        kept_choice = kept.gather(1, choices)
        return GateOutput(
            l_aux=l_aux,
            num_tokens=num_tokens,
            capacity=slots_per_expert,
            expert_index=choices,
            slot_index=slots.gather(1, choices),
            kept=kept_choice,
            weight=weights.gather(1, choices) * kept_choice,
            exp_counts=exp_counts,
            dropped=exp_counts.sum() - tokens_per_expert.sum(),
            tokens_per_expert=tokens_per_expert,
        )

    def _capacity(self, exp_counts: torch.Tensor, num_tokens: int) -> int:
        """Slots per expert: the configured capacity, or when nothing may drop the busiest
        expert's count, agreed across ranks by `capacity_fn`."""
        if self.drop_tokens:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            return capacity(num_tokens, self.num_experts, factor * self.k, self.min_capacity)
        local = int(exp_counts.max())
        if self.capacity_fn is None:
            return local
        agreed = int(self.capacity_fn(local))
        if agreed < local:
            raise ValueError(f"capacity_fn returned {agreed}, below this rank's need of {local}")
        return agreed

    def _top1(
        self, routing: torch.Tensor, gates: torch.Tensor, used: torch.Tensor | None
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor
    ]:
        """(first choices, assignments, kept assignments, slots, weights, capacity, chosen
        experts): [S, E] each but the last two, capacity an int and the chosen experts [S, k].
        The weight of a kept assignment is its expert's gate value."""
        num_tokens = routing.shape[0]
        if self.training and self.noisy_gate_policy == "RSample":
            routing = routing + _gumbel(routing)
        choice = routing.argmax(dim=1, keepdim=True)
        first = _one_hot(choice[:, 0], self.num_experts)
        if used is not None:
            first &= used
        slots_per_expert = self._capacity(first.sum(dim=0), num_tokens)

        # rank: the order in which an expert's tokens claim its slots.
        if self.use_rts:
            # Same draw as DeepSpeed's (uniform over [tokens, experts]), so a shared seed keeps the
            # same tokens; -1 puts tokens the expert did not get behind all of its own.
            priority = torch.where(first, torch.rand(first.shape, device=first.device), -1.0)
            order = priority.argsort(dim=0, descending=True, stable=True)
            positions = torch.arange(num_tokens, device=first.device)
            rank = torch.empty_like(order).scatter_(
                0, order, positions.unsqueeze(1).expand_as(order)
            )
        else:
            rank = first.cumsum(dim=0) - 1
        kept = first & (rank < slots_per_expert)
        # Kept tokens take their expert's slots in position order, whatever order chose them.
        slots = kept.cumsum(dim=0) - 1
        return first, first, kept, slots, gates, slots_per_expert, choice

    def _top2(
        self, routing: torch.Tensor, gates: torch.Tensor, used: torch.Tensor | None
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor
    ]:
        """As `_top1`; the weights are the gate values renormalised over each token's kept
        experts (DeepSpeed's gate1 / (gate1 + gate2), where a dropped choice counts 0)."""
        num_tokens = routing.shape[0]
        first_index = routing.argmax(dim=1)
        second_logits = routing
        if self.training and self.top2_2nd_expert_sampling:
            # Gumbel-max: the argmax of logits + Gumbel noise is a sample from their softmax.
            second_logits = routing + _gumbel(routing)
        second_logits = second_logits.scatter(1, first_index.unsqueeze(1), float("-inf"))
        second_index = second_logits.argmax(dim=1)
        first = _one_hot(first_index, self.num_experts)
        second = _one_hot(second_index, self.num_experts)
        if used is not None:
            first &= used
            second &= used
        assigned = first | second
        slots_per_expert = self._capacity(assigned.sum(dim=0), num_tokens)

        # An expert's first-choice tokens claim its slots before any second-choice token does,
        # each kind in position order; a kept assignment's rank is its slot.
        rank = torch.where(
            first, first.cumsum(dim=0) - 1, second.cumsum(dim=0) - 1 + first.sum(dim=0)
        )
        kept = assigned & (rank < slots_per_expert)
        kept_total = (gates * kept).sum(dim=1, keepdim=True)
        weights = gates / kept_total.clamp(min=torch.finfo(gates.dtype).eps)
        choices = torch.stack((first_index, second_index), dim=1)
        return first, assigned, kept, rank, weights, slots_per_expert, choices


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    """bool [len(index), num_classes]: F.one_hot without its range check, which on CPU reads the
    indices back (argmax's indices are in range by construction). Keeps the CPU sync count, which
    tests hold to zero, equal to CUDA's."""
    return index.unsqueeze(1) == torch.arange(num_classes, device=index.device)


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise shaped like `like`, drawn as DeepSpeed draws it (so a shared seed
    gives the same noise). Argument validation is off: it reads the parameters back on the host."""
    zero = torch.zeros((), device=like.device)
    return torch.distributions.Gumbel(zero, zero + 1, validate_args=False).rsample(like.shape)
