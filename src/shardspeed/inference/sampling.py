"""How the next token is picked from a model's logits: greedy, or sampled after temperature,
top-k and top-p (nucleus) filtering, in that order.

`SamplingParams` belongs to one request, so a batch may mix greedy rows with sampled rows of
different settings. `choose_next` takes the argmax of all greedy rows at once and samples each
group of rows that share settings and a random generator in one call. A request with a `seed`
gets a generator of its own, so what it samples does not depend on which other requests shared
its batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SamplingParams", "choose_next", "filtered_probs"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_new_tokens: most tokens to generate (at least 1).
        temperature: 0 means greedy (argmax); above 0 the logits are divided by it before
            sampling, so below 1 sharpens the distribution and above 1 flattens it.
        top_k: keep only the k most likely tokens (None: no limit).
        top_p: keep the smallest set of most likely tokens whose probabilities add up to at least
            top_p, and always the most likely one (None: no limit); in (0, 1].
        stop_token_ids: generation ends after any of these is produced (it is kept in the output).
        seed: seeds a generator of this request's own; None draws from torch's global generator.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}"
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p}")
        stops = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        # Frozen, so the normalised tuple (a list is accepted) goes in through object.__setattr__.
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k and top-p, renormalised over what is kept.

    `temperature` must be above 0 (greedy rows never get here).
    """
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token stays when the mass before it is still short of top_p: that is the smallest
        # prefix reaching top_p, and the first token (nothing before it) always stays.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_next(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """The next token of each row: LongTensor [B] from logits [B, V] (any float dtype).

    Row b is decoded with `params[b]` and, when it samples, `generators[b]` (None: torch's global
    generator). Rows sharing settings and generator are sampled in one call, so a batch of
    identical requests costs one `multinomial`.
    """
    batch = logits.size(0)
    if len(params) != batch:
        raise ValueError(f"{len(params)} SamplingParams for {batch} rows of logits")
    if generators is None:
        generators = [None] * batch
    elif len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} rows of logits")
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    greedy = [b for b in range(batch) if params[b].greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        out[rows] = logits[rows].argmax(dim=-1)
    groups: dict[tuple, list[int]] = {}
    for b in range(batch):
        p = params[b]
        if not p.greedy:
            key = (p.temperature, p.top_k, p.top_p, id(generators[b]))
            groups.setdefault(key, []).append(b)
    for (temperature, top_k, top_p, _), members in groups.items():
        rows = torch.tensor(members, device=logits.device)
        probs = filtered_probs(logits[rows], temperature, top_k, top_p)
        drawn = torch.multinomial(probs, num_samples=1, generator=generators[members[0]])
        out[rows] = drawn.squeeze(1)
    return out


HF_GENERATE_KEYS = frozenset(
    {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id"}
)


def sampling_params_from_hf(kwargs: dict[str, Any]) -> tuple[SamplingParams, int | None]:
    """(SamplingParams, pad_token_id) from Hugging Face `generate` keywords (`max_new_tokens`,
    `do_sample`, `temperature`, `top_k`, `top_p`, `eos_token_id` as one id or a list,
    `pad_token_id`). Sampling follows Hugging Face's defaults (temperature 1, top_k 50);
    without `do_sample` decoding is greedy whatever the other keys say. Any other keyword is
    an error, never dropped."""
    unknown = sorted(set(kwargs) - HF_GENERATE_KEYS)
    if unknown:
        raise TypeError(f"generate() does not take {unknown}; it takes {sorted(HF_GENERATE_KEYS)}")
    if "max_new_tokens" not in kwargs:
        raise TypeError("generate() needs max_new_tokens")
    eos = kwargs.get("eos_token_id")
    stops = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    sample = bool(kwargs.get("do_sample", False))
    params = SamplingParams(
        kwargs["max_new_tokens"],
        temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
        top_k=kwargs.get("top_k", 50) if sample else None,
        top_p=kwargs.get("top_p") if sample else None,
        stop_token_ids=stops,
    )
    return params, kwargs.get("pad_token_id")
