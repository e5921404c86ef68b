"""The hybrid engine: one model that trains with ZeRO and generates fast (DeepSpeed-Chat's actor).

Under ZeRO-3 a plain forward gathers every unit of parameters and releases it again, so naive
generation gathers the whole model once per generated token. `HybridEngine.generate` instead builds
an inference copy of the model once: a structural copy with fresh tensors (no ZeRO hooks), filled
from the shards `tp_gather_partition_size` gather units at a time, and, with `inference_tp_size` > 1,
split over that many consecutive data-parallel ranks by automatic tensor parallelism (each rank then
keeps 1/t of the copy). Generation runs on the copy with the block KV cache
(`inference.generation`); training never sees it.

The copy stays valid until the weights change (an applied optimizer step, a checkpoint load).
`pin_parameters` keeps it between generations while valid (memory for speed: a model's worth, or
1/t of it, kept on every rank); otherwise it is dropped after each `generate` and on `train()`.
`release_inference_cache` frees the KV cache after each `generate`; otherwise the cache is kept for
the next call (grown when a call needs more). Without ZeRO-3 and without inference tensor
parallelism the model itself is whole on every rank, so it generates directly, with no copy.

Under inference tensor parallelism every rank of a group calls `generate` with its own prompts; the
group gathers all of them, generates them together (every rank of the group computing its slice of
each layer) and each rank gets back its own requests' tokens. Sampling draws from generators seeded
alike on the group's ranks, so they agree on every token.

`HybridGeneration` is the part `initialize` gives the training engine when `hybrid_engine.enabled`:
the engine answers `generate` (and the names in its `surface`) from it and tells it when the
weights change (an applied step, a loaded checkpoint). `HybridEngine` and DeepSpeed's
`DeepSpeedHybridEngine` are class names for such an engine (`isinstance` views).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..checkpoint.format import Split
from ..checkpoint.sixteen_bit import gathered_items
from ..checkpoint.values import all_gather_json
from ..common.observer import EngineComponent
from ..common.views import InstanceView
from ..config.errors import ConfigError
from ..tensor_parallel.from_config import apply_autotp
from .generation import ContinuousBatcher
from .sampling import SamplingParams, sampling_params_from_hf


class HybridEngine(metaclass=InstanceView):
    """A training engine that also generates (`hybrid_engine.enabled`): one that holds a
    `HybridGeneration`. DeepSpeed calls it `DeepSpeedHybridEngine`."""

    built_by = "initialize() builds when the config enables 'hybrid_engine'"

    @staticmethod
    def describes(instance: object) -> bool:
        parts = getattr(instance, "components", ())
        return any(isinstance(part, HybridGeneration) for part in parts)


DeepSpeedHybridEngine = HybridEngine


class HybridGeneration(EngineComponent):
    """The engine's generation part (see the module docstring)."""

    surface = ("generate", "inference_module", "inference_tp_size", "generation_stats")

    def __init__(self, engine: Any) -> None:
        """`engine`: the training engine (`runtime`) this part generates for; not imported
        here, so that the runtime room may hold it without a cycle."""
        self.engine = engine
        section = engine.run_config.hybrid_engine
        topo = engine.topology
        if topo.tp_world_size > 1 or engine.moe_layers:
            raise ConfigError(
                "'hybrid_engine' works with data parallelism and ZeRO 0 to 3 (no training tensor "
                "parallelism, no MoE layers yet); use 'hybrid_engine.inference_tp_size' to split "
                "the model for generation"
            )
        self.inference_tp_size = section.inference_tp_size
        if self.inference_tp_size > 1:
            if topo.dp_world_size % self.inference_tp_size:
                raise ConfigError(
                    f"'hybrid_engine.inference_tp_size' {self.inference_tp_size} must divide the "
                    f"data-parallel size {topo.dp_world_size}"
                )
            self._tp_group, self._tp_rank = topo.data_parallel_runs(self.inference_tp_size)
        self._copy: nn.Module | None = None
        self._copy_version = -1
        self._weights_version = 0
        self._batcher: ContinuousBatcher | None = None
        self.generation_stats = {"copies_built": 0, "gather_s": 0.0, "generate_s": 0.0}

    # -- the inference copy ------------------------------------------------------------------------

    def _needs_copy(self) -> bool:
        return bool(self.engine.parameter_shards) or self.inference_tp_size > 1

    def inference_module(self) -> nn.Module:
        """The model generation runs on: the inference copy (built or rebuilt if the weights
        changed since), or the module itself when it is whole on every rank already."""
        if not self._needs_copy():
            return self.engine.module
        if self._copy is None or self._copy_version != self._weights_version:
            self._drop_copy()  # the stale one goes before the new one is made
            start = time.perf_counter()
            self._copy = self._build_copy()
            self._copy_version = self._weights_version
            self.generation_stats["copies_built"] += 1
            self.generation_stats["gather_s"] += time.perf_counter() - start
        return self._copy

    def _build_copy(self) -> nn.Module:
        engine = self.engine
        zopt = engine.optimizer
        shards = engine.parameter_shards
        # The trained parameters, and at stage 3 every parameter: the copy gets empty tensors of
        # their whole shape, filled below; the others are whole already and copied as they are.
        filled = dict(zip(zopt.params, zopt.layout.shapes)) if zopt is not None else {}
        filled.update((p, s.layout.shapes[i]) for s in shards for p, i in s.index.items())
        memo = {
            id(p): nn.Parameter(
                torch.empty(filled[p], dtype=p.dtype, device=p.device)
                if p in filled
                else p.detach().clone(),
                requires_grad=False,
            )
            for p in engine.module.parameters()
        }
        inference = copy.deepcopy(engine.module, memo)
        for sharded in shards:
            sharded.strip_hooks(inference)
        if self.inference_tp_size > 1:
            apply_autotp(inference, self._tp_group, engine.run_config.tensor_parallel)
        targets = dict(inference.named_parameters())
        names = {p: n for n, p in engine.module.named_parameters()}
        if shards:
            units = [u.params for sharded in shards for u in sharded.units]
            per = engine.run_config.hybrid_engine.tp_gather_partition_size
            chunks = [[p for u in units[i : i + per] for p in u] for i in range(0, len(units), per)]
        else:
            chunks = [list(filled)]
        for item in gathered_items(engine, chunks, names):
            for name, whole in item:
                self._fill(targets[name], whole)
        return inference.eval()

    def _fill(self, target: torch.Tensor, whole: torch.Tensor) -> None:
        """Copy `whole` into the copy's parameter: all of it, or its tensor-parallel slice."""
        if getattr(target, "tensor_model_parallel", False) and self.inference_tp_size > 1:
            split = Split(
                target.partition_dim, self.inference_tp_size, getattr(target, "partition_stride", 1)
            )
            whole = split.piece(whole, self._tp_rank)
        target.copy_(whole.reshape(target.shape))

    def _drop_copy(self) -> None:
        self._copy = None
        self._batcher = None  # its cache and adapter belong to the copy

    # -- generation --------------------------------------------------------------------------------

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """Generate with the inference copy, then return to training.

        Two forms: `generate(prompts, params)` with token-id lists and a `SamplingParams` (or one
        per prompt) returns the new tokens per prompt; the Hugging Face form
        `generate(input_ids, max_new_tokens=..., do_sample=..., temperature=..., top_k=...,
        top_p=..., eos_token_id=..., pad_token_id=...)` returns a [B, T + new] tensor of prompt
        and new tokens, right-padded with `pad_token_id` (or the EOS token)."""
        first = inputs[0] if inputs else kwargs.get("input_ids")
        if isinstance(first, torch.Tensor):
            return self._generate_hf(*inputs, **kwargs)
        prompts, params = (*inputs, kwargs.pop("params", None))[:2]
        if kwargs or params is None:
            raise TypeError(
                "generate(prompts, params): token-id lists and SamplingParams, nothing else "
                f"(got {sorted(kwargs)}); or generate(input_ids_tensor, **hf_kwargs)"
            )
        return self._generate(prompts, params)

    def _generate_hf(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        input_ids = kwargs.pop("input_ids", input_ids)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("generate(input_ids, ...) needs a [batch, length] LongTensor")
        mask = kwargs.pop("attention_mask", None)
        params, pad = sampling_params_from_hf(kwargs)
        rows = input_ids.tolist()
        if mask is not None:  # left or right padding: keep each row's real tokens
            rows = [[t for t, m in zip(r, ms) if m] for r, ms in zip(rows, mask.tolist())]
        new = self._generate(rows, params)
        pad = pad if pad is not None else (params.stop_token_ids or (0,))[0]
        width = max(len(r) + len(n) for r, n in zip(rows, new))
        out = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, (r, n) in enumerate(zip(rows, new)):
            out[i, : len(r) + len(n)] = torch.tensor(r + n, dtype=torch.long)
        return out.to(input_ids.device)

    def _generate(
        self,
        prompts: Sequence[Sequence[int]] | torch.Tensor,
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[int]]:
        rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
        per_prompt = [params] * len(rows) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(rows):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(rows)} prompts")
        section = self.engine.run_config.hybrid_engine
        limit = section.max_out_tokens
        for row, p in zip(rows, per_prompt):
            if len(row) + p.max_new_tokens > limit:
                raise ValueError(
                    f"a prompt of {len(row)} tokens plus max_new_tokens {p.max_new_tokens} exceeds "
                    f"'hybrid_engine.max_out_tokens' {limit}"
                )
        try:
            model = self.inference_module()
            start = time.perf_counter()
            mine = slice(0, len(rows))
            if self.inference_tp_size > 1:
                rows, per_prompt, mine = self._gather_requests(rows, per_prompt)
            batcher = self._batcher_for(model, rows, per_prompt)
            ids = [batcher.add_request(r, p) for r, p in zip(rows, per_prompt)]
            results = batcher.run()
            self.generation_stats["generate_s"] += time.perf_counter() - start
            return [results[i] for i in ids][mine]
        finally:  # training never runs next to an unpinned copy
            if section.release_inference_cache:
                self._batcher = None
            if not section.pin_parameters:
                self._drop_copy()

    def _batcher_for(
        self, model: nn.Module, rows: list[list[int]], params: list[SamplingParams]
    ) -> ContinuousBatcher:
        """A batcher on `model` whose cache holds all these requests at once: the kept one if it
        is big enough, else a new one."""
        size = 16
        need = sum(-(-(len(r) + p.max_new_tokens - 1) // size) for r, p in zip(rows, params))
        kept = self._batcher
        fits = kept is not None and (kept.cache is None or kept.cache.num_blocks >= need)
        if kept is None or kept.model is not model or not fits:
            kept = ContinuousBatcher(model, max(1, len(rows)), max(1, need), size)
        kept.max_batch_size = max(1, len(rows))
        self._batcher = kept
        return kept

    def _gather_requests(
        self, rows: list[list[int]], params: list[SamplingParams]
    ) -> tuple[list[list[int]], list[SamplingParams], slice]:
        """Every request of the inference tensor-parallel group, the same on each of its ranks,
        and where this rank's are among them. Unseeded sampling gets seeds from the group's
        first rank, so that every rank draws the same tokens."""
        # Drawn from the global generator like any unseeded sampling, and only then: greedy
        # generation leaves training's random stream (dropout) untouched.
        unseeded = any(p.seed is None and p.temperature > 0 for p in params)
        base = int(torch.randint(0, 2**31 - 1, ())) if unseeded else 0
        mine = [[r, _params_json(p)] for r, p in zip(rows, params)]
        everyone = all_gather_json({"requests": mine, "seed": base}, group=self._tp_group)
        seed = everyone[0]["seed"]
        all_rows, all_params, start = [], [], 0
        for rank, part in enumerate(everyone):
            if rank == self._tp_rank:
                start = len(all_rows)
            for row, p in part["requests"]:
                all_rows.append(row)
                if p["seed"] is None and p["temperature"] > 0:
                    p["seed"] = seed + len(all_params)
                p["stop_token_ids"] = tuple(p["stop_token_ids"])
                all_params.append(SamplingParams(**p))
        return all_rows, all_params, slice(start, start + len(rows))

    # -- the weights change ----------------------------------------------------------------------

    def after_step(self, engine: Any) -> None:
        if engine.was_step_applied():
            self._weights_version += 1  # the copy is stale from here

    def after_load(self, engine: Any) -> None:
        self._weights_version += 1


def _params_json(params: SamplingParams) -> dict[str, Any]:
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
        "seed": params.seed,
    }
