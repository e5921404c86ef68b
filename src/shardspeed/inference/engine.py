"""`init_inference` (DeepSpeed's `deepspeed.init_inference`): a model made ready to serve.

`InferenceEngine(model, config)` does, in order:

1. the tensor-parallel group: `tensor_parallel.tp_group`, the `mpu`'s model-parallel group, or
   runs of `tp_size` consecutive ranks, which the world's mesh hands out (the world size must be
   a multiple);
2. splits the model over it with automatic tensor parallelism (built-in rules, or the rules
   `injection_policy` names);
3. loads `checkpoint` (a shardspeed tag or save directory, or Hugging Face safetensors), each
   rank reading only the bytes of its own piece of every split tensor;
4. casts to `dtype` and moves the model to the accelerator (unless `keep_module_on_host`);
   `dtype` int8 instead quantizes the linear weights (weight-only int8, see quantization.py);
5. compiles the forward with torch.compile for `replace_with_kernel_inject` (in place of
   DeepSpeed's hand-written kernels) and with mode "reduce-overhead" (CUDA graphs) for
   `enable_cuda_graph`.

`forward` is the model's forward. `generate` runs the shared generation loop
(`shardspeed.inference.generation.generate`) in Hugging Face's form (a token tensor in, prompt plus
new tokens out) or in shardspeed's (prompt lists and `SamplingParams` in, new tokens out), with
`max_out_tokens` and `min_out_tokens` enforced.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.engine_state import LATEST, open_checkpoint, resolve_tag
from ..checkpoint.format import MANIFEST, CheckpointError, Split, TensorSource
from ..checkpoint.hf import INDEX, SINGLE, hf_source
from ..comm import broadcast, init_distributed
from ..comm.topology import Topology
from ..config.errors import ConfigError
from ..tensor_parallel.autotp import auto_tensor_parallel
from .config import InferenceConfig, load_inference_config
from .generation import generate as generate_tokens
from .quantization import QuantizationReport, quantize_linears
from .sampling import SamplingParams

__all__ = ["InferenceEngine", "init_inference"]

logger = logging.getLogger("shardspeed")

# Hugging Face's GenerationConfig defaults, for models that bring no generation_config.
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20,
    "max_new_tokens": None,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "eos_token_id": None,
    "pad_token_id": None,
    "num_beams": 1,
}
# Arguments of the shared generate that the Hugging Face form passes through.
LOOP_OPTIONS = ("cache_blocks", "block_size", "max_batch_size", "use_cache")


def init_inference(
    model: nn.Module,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """Wrap `model` for inference (`deepspeed.init_inference`).

    `config`: a dict or the path of a JSON file; `kwargs` are merged into it, and the same key with
    different values in both is an error. Raises ConfigError (a ValueError) naming each bad key.
    """
    return InferenceEngine(model, load_inference_config(config, **kwargs))


class InferenceEngine(nn.Module):
    """`model` split, loaded, cast or quantized and compiled as `config` says (see the module
    docstring). The wrapped model is `engine.module`; `engine.config` is its own config (as in
    DeepSpeed), the validated inference config is `engine.inference_config`."""

    def __init__(self, model: nn.Module, config: InferenceConfig) -> None:
        super().__init__()
        device = _device(config)
        _check_cuda_graph(config, device)
        self.module = model
        self.inference_config = config
        self.config = getattr(model, "config", None)
        self.tp_group, self.tp_world_size, self.tp_rank = _tensor_parallel_group(config)
        self.mp_group = self.tp_group  # DeepSpeed's name
        self.quantization_report: QuantizationReport | None = None
        self._is_compiled = False
        model.eval()  # dropout off: serving is deterministic

        policy = None
        if config.injection_policy:
            # Built at any size: a policy naming layers the model lacks is an error, as in DeepSpeed.
            policy = policy_from_injection(model, config.injection_policy)
        if self.tp_world_size > 1:
            if config.enable_cuda_graph:
                raise ConfigError(
                    "'enable_cuda_graph' does not combine with tensor parallelism (nor does it in "
                    "DeepSpeed): the graphs would capture the collectives"
                )
            auto_tensor_parallel(model, self.tp_group, policy)
        if config.checkpoint:
            path = Path(config.base_dir) / config.checkpoint
            load_pieces(model, checkpoint_source(path), self.tp_rank, self.tp_world_size)
        if config.dtype != "int8":
            model.to(config.torch_dtype)
        model.to(device)
        if config.dtype == "int8":
            groups = config.quant.weight.q_groups
            self.quantization_report = quantize_linears(model, groups=groups)
            _log_rank0(str(self.quantization_report))
        if config.enable_cuda_graph:
            self.compile(compile_kwargs={"mode": "reduce-overhead"})
        elif config.replace_with_kernel_inject:
            self.compile()
        _log_rank0(
            f"init_inference: {type(model).__name__}, tensor parallel {self.tp_world_size}, "
            f"dtype {config.dtype} on {device}"
            + (f", weights from {config.checkpoint}" if config.checkpoint else "")
            + (", compiled" if self._is_compiled else "")
        )

    # -- running ---------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        return self.module(*args, **kwargs)

    def compile(
        self, backend: str = "inductor", compile_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """torch.compile the model's forward in place (DeepSpeed's `engine.compile`); once."""
        if self._is_compiled:
            return
        self.module.compile(backend=backend, **dict(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor | list[list[int]]:
        """Generate with the shared loop, in either of two forms.

        Hugging Face's: `generate(input_ids, attention_mask=None, max_new_tokens=..., do_sample=...,
        temperature=..., top_k=..., top_p=..., eos_token_id=..., pad_token_id=..., max_length=...,
        generation_config=...)` returns a LongTensor of each prompt followed by its new tokens,
        rows that stopped early padded with `pad_token_id` (the EOS token if unset). A batch of
        prompts of different lengths comes left-padded with its `attention_mask`. Unset options
        come from the model's `generation_config` (Hugging Face's defaults without one).

        shardspeed's: `generate(prompts, params, **options)` with token-id lists and one
        `SamplingParams` (or one per prompt) returns the new tokens of each prompt; `options` are
        the shared generate's (`cache_blocks`, `block_size`, `max_batch_size`, `use_cache`).

        Every prompt plus the tokens asked for must fit in `max_out_tokens`, and the prompt plus
        `min_out_tokens` too. Under tensor parallelism every rank of a group must pass the same
        prompts; sampling then draws the same tokens on all of them (see `_same_seeds`).
        """
        params = kwargs.pop("params", None)
        if params is None and len(args) > 1 and _is_sampling_params(args[1]):
            params, args = args[1], args[:1]
        elif len(args) == 2:  # Hugging Face's second positional argument
            kwargs["generation_config"], args = args[1], args[:1]
        if params is not None:
            if len(args) != 1:
                raise TypeError("generate(prompts, params, **options): give the prompts once")
            return self._generate_prompts(args[0], params, kwargs)
        if len(args) > 1:
            raise TypeError("generate takes input_ids as its only positional argument")
        input_ids = args[0] if args else kwargs.pop("input_ids", None)
        if input_ids is None:
            raise TypeError("generate needs input_ids (or prompts and SamplingParams)")
        return self._generate_hf(input_ids, kwargs)

    def _generate_prompts(
        self, prompts: Any, params: Any, options: dict[str, Any]
    ) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        rows = [[int(t) for t in p] for p in prompts]
        per_prompt = [params] * len(rows) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(rows):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(rows)} prompts")
        for row, p in zip(rows, per_prompt):
            self._check_length(len(row), p.max_new_tokens)
        return generate_tokens(self.module, rows, self._same_seeds(per_prompt), **options)

    def _generate_hf(self, input_ids: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, length] LongTensor")
        attention_mask = options.pop("attention_mask", None)
        settings = dict(HF_DEFAULTS)
        generation_config = options.pop("generation_config", None) or getattr(
            self.module, "generation_config", None
        )
        # As in Hugging Face's generate, None means "unset": the default applies.
        if generation_config is not None:
            settings.update(_set_values(vars(generation_config), settings))
        loop = {k: options.pop(k) for k in LOOP_OPTIONS if k in options}
        unknown = sorted(set(options) - set(HF_DEFAULTS))
        if unknown:
            raise TypeError(
                f"generate does not support {unknown}; it takes input_ids, attention_mask, "
                f"generation_config, {', '.join(HF_DEFAULTS)} and {', '.join(LOOP_OPTIONS)}"
            )
        settings.update(_set_values(options, settings))
        if settings["num_beams"] != 1:
            raise NotImplementedError(
                f"beam search (num_beams={settings['num_beams']}) is not offered (nor is it by "
                "DeepSpeed's inference engine): use num_beams=1"
            )
        prompts = _prompts(input_ids, attention_mask)
        longest = input_ids.size(1)
        max_new = settings["max_new_tokens"]
        if max_new is None:
            max_new = settings["max_length"] - longest
            if max_new < 1:
                raise ValueError(
                    f"max_length {settings['max_length']} leaves no room after the "
                    f"{longest}-token input: set max_new_tokens"
                )
        stops = settings["eos_token_id"]
        stops = () if stops is None else (stops,) if isinstance(stops, int) else tuple(stops)
        if settings["do_sample"]:
            if not settings["temperature"] or settings["temperature"] <= 0:
                raise ValueError(
                    f"do_sample needs a temperature above 0, got {settings['temperature']}"
                )
            top_p = settings["top_p"]
            params = SamplingParams(
                max_new,
                temperature=float(settings["temperature"]),
                top_k=settings["top_k"] or None,
                top_p=None if top_p is None or top_p >= 1 else float(top_p),
                stop_token_ids=stops,
            )
        else:
            params = SamplingParams(max_new, stop_token_ids=stops)
        new = self._generate_prompts(prompts, params, loop)
        pad = settings["pad_token_id"]
        pad = stops[0] if pad is None and stops else pad
        width = max(len(t) for t in new)
        if pad is None and any(len(t) < width for t in new):
            raise ValueError("rows stopped early and there is no pad_token_id to pad them with")
        out = torch.full((len(new), width), pad if pad is not None else 0, dtype=input_ids.dtype)
        for row, tokens in enumerate(new):
            out[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        return torch.cat([input_ids, out.to(input_ids.device)], dim=1)

    def _check_length(self, prompt: int, max_new: int) -> None:
        cap = self.inference_config.max_out_tokens
        if prompt + max_new > cap:
            raise ValueError(
                f"a prompt of {prompt} tokens plus {max_new} new tokens is {prompt + max_new} "
                f"tokens, above the engine's max_out_tokens {cap} (the cap on prompt plus "
                "generated tokens): raise 'max_out_tokens' in the inference config or ask for "
                "fewer tokens"
            )
        least = self.inference_config.min_out_tokens
        if prompt + least > cap:
            raise ValueError(
                f"a prompt of {prompt} tokens leaves {cap - prompt} of max_out_tokens {cap} to "
                f"generate in, fewer than min_out_tokens {least}: shorten the prompt or raise "
                "'max_out_tokens'"
            )

    def _same_seeds(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """Under tensor parallelism every rank must draw the same tokens: each sampled request
        without a seed gets one from tensor-parallel rank 0's generator, broadcast to the group
        (with one rank, torch's global generator is used as is)."""
        unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        if self.tp_world_size == 1 or not unseeded:
            return params
        base = torch.randint(0, 2**62, (1,), dtype=torch.long)
        broadcast(base, dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        seeded = list(params)
        for n, i in enumerate(unseeded):
            seeded[i] = dataclasses.replace(params[i], seed=int(base) + n)
        return seeded


def _is_sampling_params(value: Any) -> bool:
    if isinstance(value, SamplingParams):
        return True
    return isinstance(value, Sequence) and all(isinstance(p, SamplingParams) for p in value)


def _set_values(given: Mapping[str, Any], known: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in given.items() if k in known and v is not None}


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens; with a mask, the left padding it marks (zeros) is dropped."""
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} and input_ids "
            f"{tuple(input_ids.shape)} differ in shape"
        )
    valid = attention_mask.bool().cpu()
    lengths = valid.sum(dim=1)
    width = input_ids.size(1)
    left_padded = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    bad = (valid != left_padded).any(dim=1).nonzero().flatten().tolist()
    if bad or bool((lengths == 0).any()):
        raise ValueError(
            "attention_mask must mark left padding (zeros before each prompt's tokens, at least "
            f"one token per row), as batched decoder-only generation expects; rows {bad} do not"
        )
    return [row[width - n :] for row, n in zip(input_ids.tolist(), lengths.tolist())]


# -- setup ---------------------------------------------------------------------------------------


def _tensor_parallel_group(config: InferenceConfig) -> tuple[Any, int, int]:
    """(group, size, this rank's index in it); (None, 1, 0) without tensor parallelism."""
    tp = config.tensor_parallel
    if tp.tp_group is not None:
        group = tp.tp_group
    elif tp.mpu is not None:
        group = tp.mpu.get_model_parallel_group()
    elif tp.enabled and tp.tp_size > 1:
        init_distributed()
        world = dist.get_world_size()
        if world % tp.tp_size:
            raise ConfigError(
                f"'tensor_parallel.tp_size' {tp.tp_size} must divide the world size {world} "
                "(ranks form consecutive groups of tp_size)"
            )
        group, _ = Topology.world().data_parallel_runs(tp.tp_size)
    else:
        return None, 1, 0
    size = dist.get_world_size(group)
    if tp.tp_size > 1 and size != tp.tp_size:
        raise ConfigError(
            f"'tensor_parallel.tp_size' {tp.tp_size} differs from the size {size} of the group "
            "given by 'tensor_parallel.tp_group' / 'mpu': leave tp_size out"
        )
    return group, size, dist.get_rank(group)


def _device(config: InferenceConfig) -> torch.device:
    if torch.cuda.is_available() and not config.keep_module_on_host:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_cuda_graph(config: InferenceConfig, device: torch.device) -> None:
    if config.enable_cuda_graph and device.type != "cuda":
        raise ConfigError(
            "'enable_cuda_graph' needs a CUDA device (CUDA graphs replay recorded CUDA kernels); "
            f"this model would run on {device.type}: remove it"
        )


def _log_rank0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def policy_from_injection(
    model: nn.Module, injection: Mapping[Any, str | Sequence[str]]
) -> dict[str, list[str]]:
    """DeepSpeed's `injection_policy` as an automatic tensor parallelism policy.

    `{module class (or class or module name): (row-parallel linear names, ...)}`: inside every
    matching module, the linears whose names (relative to it) end with one of the given names are
    split by rows (their outputs are all-reduced); every other linear in it is split by columns,
    as DeepSpeed does. Each name must match a layer of the model.
    """
    names = [n for n, _ in model.named_modules()]
    column: list[str] = []
    row: list[str] = []
    for key, row_names in injection.items():
        row_names = (row_names,) if isinstance(row_names, str) else tuple(row_names)
        label = key.__name__ if isinstance(key, type) else str(key)
        for row_name in row_names:
            if not any(n == row_name or n.endswith(f".{row_name}") for n in names):
                raise ConfigError(
                    f"'injection_policy' {label}: no layer of {type(model).__name__} is called "
                    f"{row_name!r}"
                )
        owners = [n for n, m in model.named_modules() if _is_policy_key(key, n, m)]
        if not owners:
            raise ConfigError(
                f"'injection_policy': {type(model).__name__} has no module {label!r} (a class, or "
                "a class or module name)"
            )
        for owner in owners:
            for sub, module in model.get_submodule(owner).named_modules():
                if not sub or not _linear_like(module):
                    continue
                full = f"{owner}.{sub}" if owner else sub
                is_row = any(sub == r or sub.endswith(f".{r}") for r in row_names)
                (row if is_row else column).append(f"^{re.escape(full)}$")
    return {"column": column, "row": row}


def _is_policy_key(key: Any, name: str, module: nn.Module) -> bool:
    if isinstance(key, type):
        return isinstance(module, key)
    return type(module).__name__ == key or name == key


# -- checkpoint loading --------------------------------------------------------------------------


def checkpoint_source(path: str | os.PathLike) -> TensorSource:
    """The tensors at `path`: a shardspeed tag (with manifest.json), a save directory (whose
    `latest` names the tag), or Hugging Face safetensors (a file, an index, or a directory)."""
    path = Path(path)
    if path.is_dir() and (path / MANIFEST).exists():
        return open_checkpoint(path)[1]
    if path.is_dir() and (path / LATEST).exists():
        return open_checkpoint(resolve_tag(str(path), None))[1]
    hf_file = path.is_file() and (path.name.endswith(".safetensors") or path.name == INDEX)
    if hf_file or (path.is_dir() and ((path / SINGLE).exists() or (path / INDEX).exists())):
        return hf_source(path)
    raise ConfigError(
        f"'checkpoint' {str(path)!r}: not a shardspeed checkpoint (a tag directory with "
        f"{MANIFEST}, or a save directory with '{LATEST}') nor Hugging Face safetensors "
        f"({SINGLE}, {INDEX} or a .safetensors file)"
    )


@torch.no_grad()
def load_pieces(model: nn.Module, source: TensorSource, rank: int, size: int) -> None:
    """Overwrite `model`'s parameters and saved buffers with `source`'s, each tensor-parallel
    parameter with this rank's piece only (its `partition_dim` / `partition_stride` say which)."""
    params = dict(model.named_parameters())
    saved = {n[len("param/") :] for n in source.names("param/")}
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers()}
    missing, unexpected = sorted(set(params) - saved), sorted(saved - known)
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint does not match {type(model).__name__}: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}"
        )
    for name, param in params.items():
        split = None
        if size > 1 and getattr(param, "tensor_model_parallel", False):
            split = Split(param.partition_dim, size, getattr(param, "partition_stride", 1))
        whole = tuple(param.shape) if split is None else split.whole_shape(tuple(param.shape))
        stored = source.shape(f"param/{name}")
        if whole != stored:
            raise CheckpointError(
                f"parameter '{name}' has shape {stored} in the checkpoint and {whole} in the model"
            )
        param.copy_(_read_piece(source, f"param/{name}", stored, split, rank).view(param.shape))
    for name, buffer in model.named_buffers():
        if f"buffer/{name}" in source:
            buffer.copy_(source.read_whole(f"buffer/{name}"))


def _read_piece(
    source: TensorSource, logical: str, shape: tuple[int, ...], split: Split | None, rank: int
) -> torch.Tensor:
    """Rank `rank`'s piece of `logical` under `split`, reading as little as the storage allows."""
    if split is None:
        return source.read_whole(logical)
    if logical in source.splits:
        saved, parts = source.splits[logical]
        if saved == split:  # saved by ranks split the same way: this rank's piece is stored whole
            return source.read_whole(parts[rank])
        # Split another way: the pieces are joined, then cut (TensorSource caches nothing else).
        return source.read_piece(logical, split, rank, 0, math.prod(shape) // split.parts)
    # Stored whole (row-major): the piece is, for each index before `dim` and each fused part,
    # one contiguous run of width x (elements after `dim`).
    dim = split.dim
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    block = shape[dim] // split.stride
    width = block // split.parts
    runs = [
        source.read(logical, ((o * shape[dim]) + j * block + rank * width) * inner, width * inner)
        for o in range(outer)
        for j in range(split.stride)
    ]
    return torch.cat(runs)
