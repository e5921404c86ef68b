"""Generation over a block KV cache: `generate` for a list of prompts, on top of
`ContinuousBatcher`, which serves requests as they come.

Each `step()` of the batcher first admits waiting requests, in arrival order, while the batch has
room and the cache has blocks for them, and prefills them (one forward per group of equal prompt
length), which gives each its first token; then one batched decode forward gives every running
sequence, the ones just prefilled included, its next token. A sequence that produces a stop token
or reaches `max_new_tokens` leaves at once and its blocks go back to the free list, so the next
request joins while the others keep going (continuous batching). With `continuous=False` the
batcher admits only into an empty batch, so a batch runs until its longest request is done: the
static batching that continuous batching is measured against.

Admission reserves a request's worst case, ceil((prompt + max_new_tokens - 1) / block_size)
blocks (the last token generated is never fed back, so it is never cached). Blocks are still
taken only as tokens arrive; the reservation guarantees that a running sequence never finds the
cache full mid-generation, which would need preemption. A request that stops early hands back its
reservation when it stops. Admission is first come, first served: a large request at the head of
the queue waits for blocks rather than being overtaken forever by smaller ones.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .models import ModelAdapter, RecomputeAdapter, adapter_for
from .sampling import SamplingParams, choose_next

__all__ = ["ContinuousBatcher", "GenerationStats", "generate"]


@dataclass
class GenerationStats:
    """Counters of a `ContinuousBatcher` since it was made, for benchmarks and tests."""

    steps: int = 0
    """`step()` calls that did work."""
    prefill_tokens: int = 0
    """Prompt tokens run through the model."""
    decode_steps: int = 0
    """Batched decode forwards (one per step that had running sequences)."""
    tokens_generated: int = 0
    peak_blocks_in_use: int = 0
    peak_batch_size: int = 0
    """Most sequences in one decode forward."""
    joined_while_running: int = 0
    """Requests admitted while other requests were mid-generation."""
    waited_for_blocks: int = 0
    """Steps where the batch had room but the next request's blocks were not free."""
    finished: int = 0


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    blocks: int
    tokens: list[int] = field(default_factory=list)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the duration; the modules that were training are put back exactly."""
    training = [m for m in model.modules() if m.training]
    model.eval()
    try:
        yield
    finally:
        for module in training:
            module.training = True


class ContinuousBatcher:
    """Serves generation requests on one model with a shared block KV cache (see the module
    docstring for how a step admits, prefills and decodes).

    Args:
        model: anything `adapter_for` takes (the example GPT, a Hugging Face causal LM, or any
            module from ids to logits, run without a cache).
        max_batch_size: most sequences generating at once.
        cache_blocks: blocks in the KV cache; required unless the model runs without a cache.
        block_size: tokens per block.
        continuous: False admits only into an empty batch (static batching).
        use_cache: False runs every model through `RecomputeAdapter` (no KV cache).

    `stats` counts what happened; `cache` is the `BlockKVCache` (None without a cache).
    """

    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int = 8,
        cache_blocks: int | None = None,
        block_size: int = 16,
        *,
        continuous: bool = True,
        use_cache: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model = model
        self.adapter: ModelAdapter = adapter_for(model) if use_cache else RecomputeAdapter(model)
        self.cache = None
        if self.adapter.uses_cache:
            if cache_blocks is None:
                raise ValueError(
                    f"cache_blocks is required for {type(self.adapter).__name__} "
                    "(or use_cache=False)"
                )
            self.cache = self.adapter.make_cache(cache_blocks, block_size)
        self.max_batch_size = max_batch_size
        self.continuous = continuous
        self.stats = GenerationStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._results: dict[int, list[int]] = {}
        self._reserved = 0
        self._next_id = 0

    def add_request(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams) -> int:
        """Queue a prompt (token ids, not empty); returns the request's id.

        Raises ValueError when the request could never run: longer than the model's positions, or
        needing more blocks than the whole cache has.
        """
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        held = len(prompt) + params.max_new_tokens - 1
        limit = self.adapter.max_positions
        if limit is not None and held > limit:
            raise ValueError(
                f"prompt of {len(prompt)} tokens plus max_new_tokens={params.max_new_tokens} needs "
                f"{held} positions but the model has {limit}"
            )
        blocks = 0
        if self.cache is not None:
            blocks = self.cache.blocks_for(held)
            if blocks > self.cache.num_blocks:
                raise ValueError(
                    f"request needs {blocks} blocks of {self.cache.block_size} tokens "
                    f"({len(prompt)} prompt + {params.max_new_tokens - 1} generated tokens "
                    f"cached) but the whole cache has {self.cache.num_blocks} blocks"
                )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.adapter.device).manual_seed(params.seed)
        request = _Request(self._next_id, prompt, params, generator, blocks)
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def has_pending(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running)

    def step(self) -> list[int]:
        """Admit and prefill what fits, then decode one token for every running sequence.

        Returns the ids of the requests that finished in this step.
        """
        if not self.has_pending():
            return []
        finished: list[int] = []
        with torch.inference_mode(), _eval_mode(self.model):
            admitted = self._admit()
            if admitted:
                self.stats.prefill_tokens += sum(len(r.prompt) for r in admitted)
                logits = self.adapter.forward(
                    [r.prompt for r in admitted], [r.id for r in admitted], self.cache
                )
                finished += self._emit(admitted, logits)
            if self._running:
                batch = list(self._running)
                self.stats.decode_steps += 1
                self.stats.peak_batch_size = max(self.stats.peak_batch_size, len(batch))
                logits = self.adapter.forward(
                    [[r.tokens[-1]] for r in batch], [r.id for r in batch], self.cache
                )
                finished += self._emit(batch, logits)
        self.stats.steps += 1
        return finished

    def run(self) -> dict[int, list[int]]:
        """Step until nothing is pending; the generated tokens of every finished request by id."""
        while self.has_pending():
            self.step()
        return dict(self._results)

    def _admit(self) -> list[_Request]:
        if not self.continuous and self._running:
            return []
        others_running = bool(self._running)
        admitted = []
        capacity = self.cache.num_blocks if self.cache is not None else 0
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting[0]
            if self._reserved + request.blocks > capacity:
                self.stats.waited_for_blocks += 1
                break
            self._waiting.popleft()
            self._reserved += request.blocks
            if self.cache is not None:
                self.cache.add_sequence(request.id)
            self._running.append(request)
            admitted.append(request)
        if others_running:
            self.stats.joined_while_running += len(admitted)
        return admitted

    def _emit(self, batch: list[_Request], logits: torch.Tensor) -> list[int]:
        """Choose each sequence's next token and retire those that are done."""
        chosen = choose_next(
            logits.float(), [r.params for r in batch], [r.generator for r in batch]
        ).tolist()
        if self.cache is not None:
            self.stats.peak_blocks_in_use = max(
                self.stats.peak_blocks_in_use, self.cache.blocks_in_use()
            )
        finished = []
        for request, token in zip(batch, chosen):
            request.tokens.append(token)
            self.stats.tokens_generated += 1
            params = request.params
            if token in params.stop_token_ids or len(request.tokens) == params.max_new_tokens:
                self._finish(request)
                finished.append(request.id)
        return finished

    def _finish(self, request: _Request) -> None:
        # Freed now, not at the end of the step, so the next step can admit into these blocks.
        self._running.remove(request)
        if self.cache is not None:
            self.cache.free(request.id)
        self.adapter.free(request.id)
        self._reserved -= request.blocks
        self._results[request.id] = request.tokens
        self.stats.finished += 1


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    *,
    cache_blocks: int | None = None,
    block_size: int = 16,
    max_batch_size: int | None = None,
    use_cache: bool = True,
    continuous: bool = True,
) -> list[list[int]]:
    """The new tokens generated for each prompt (ending with its stop token, if it produced one).

    `prompts` are token-id lists, or a [B, T] LongTensor of unpadded prompts; `params` is one
    `SamplingParams` for all or one per prompt. `max_batch_size` defaults to all prompts at once
    and `cache_blocks` to enough blocks for the largest `max_batch_size` requests together, so
    that only the batch size limits admission. The other arguments are `ContinuousBatcher`'s.
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(
                f"prompts as a tensor must be [B, T], got shape {tuple(prompts.shape)}"
            )
        prompts = prompts.tolist()
    rows = [list(p) for p in prompts]
    if isinstance(params, SamplingParams):
        per_prompt = [params] * len(rows)
    else:
        per_prompt = list(params)
        if len(per_prompt) != len(rows):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(rows)} prompts")
    if not rows:
        return []
    max_batch_size = max_batch_size or len(rows)
    if cache_blocks is None:
        needs = sorted(
            (
                math.ceil((len(p) + q.max_new_tokens - 1) / block_size)
                for p, q in zip(rows, per_prompt)
            ),
            reverse=True,
        )
        cache_blocks = max(1, sum(needs[:max_batch_size]))
    batcher = ContinuousBatcher(
        model,
        max_batch_size,
        cache_blocks,
        block_size,
        continuous=continuous,
        use_cache=use_cache,
    )
    ids = [batcher.add_request(p, q) for p, q in zip(rows, per_prompt)]
    results = batcher.run()
    return [results[i] for i in ids]
