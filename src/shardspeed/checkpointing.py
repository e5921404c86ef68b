"""`shardspeed.checkpointing` (DeepSpeed's `deepspeed.checkpointing`): activation checkpointing.

`checkpoint(function, *args)` runs `function` without keeping its intermediate activations and
recomputes them in backward. It is torch's non-reentrant checkpoint, so inputs that need no gradient
work and it composes with the rest of autograd; torch keeps the tensors it is given as the inputs of
the recompute, and this module decides what those are:

- by default, the inputs themselves;
- `partition_activations`: each of the t tensor-parallel ranks keeps 1/t of every floating-point
  input (the inputs of a tensor-parallel layer are the same on all t ranks, so the pieces together
  are the whole), and the recompute all-gathers them;
- `cpu_checkpointing`: the kept tensors live in host memory until the recompute.

`function` itself gets the real inputs in forward and the restored ones at recompute. The RNG
states are those of the forward at recompute (torch restores the CPU and device generators; this
module restores the streams of `get_cuda_rng_tracker()`), so dropout draws the same masks.

Settings come from `configure` (DeepSpeed's call, with the script's Megatron `mpu`) or from the
engine, which applies the config's `activation_checkpointing` section (`configure_from_config`):
DeepSpeed ignores that section unless the script also calls `configure`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from . import comm
from .config.errors import ConfigError
from .config.loader import read_config_source, validation_problems
from .config.schema import ActivationCheckpointingConfig

__all__ = [
    "CudaRNGStatesTracker",
    "calls",
    "checkpoint",
    "configure",
    "configure_from_config",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
]

logger = logging.getLogger("shardspeed")

SECTION = "activation_checkpointing"
MODEL_PARALLEL_RNG = "model-parallel-rng"


@dataclass(frozen=True)
class _Settings:
    partition: bool = False
    cpu: bool = False
    synchronize: bool = False
    profile: bool = False
    group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    configured: bool = False


_settings = _Settings()
_calls = 0


# -- configuration ---------------------------------------------------------------------------------


def configure(
    mpu_: Any,
    deepspeed_config: Mapping[str, Any] | str | os.PathLike | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's call: settings from `deepspeed_config`'s `activation_checkpointing` section (a dict
    or a JSON file), each overridden by the argument of that name when it is not None.

    `mpu_` is a Megatron-style object (`get_model_parallel_group()`, `_rank()`, `_world_size()`)
    whose group partitioned activations are split over; None keeps the one given before (none at
    first: no tensor parallelism). `num_checkpoints` is accepted and has no effect, as in DeepSpeed
    without `contiguous_checkpointing` (it only sized those buffers; Megatron scripts always pass it).
    Raises ConfigError naming each bad key or argument.
    """
    raw = read_config_source(deepspeed_config).get(SECTION, {}) if deepspeed_config else {}
    given = {
        key: (name, value)
        for name, key, value in (
            ("partition_activations", "partition_activations", partition_activations),
            (
                "contiguous_checkpointing",
                "contiguous_memory_optimization",
                contiguous_checkpointing,
            ),
            ("num_checkpoints", "number_checkpoints", num_checkpoints),
            ("checkpoint_in_cpu", "cpu_checkpointing", checkpoint_in_cpu),
            ("synchronize", "synchronize_checkpoint_boundary", synchronize),
            ("profile", "profile", profile),
        )
        if value is not None
    }
    configure_from_config(_validated(raw, given), mpu_)


def _validated(raw: Any, given: dict[str, tuple[str, Any]]) -> ActivationCheckpointingConfig:
    """The section `raw` with the arguments `given` (config key -> (argument, value)) over it; each
    problem names its config key or argument."""
    model = ActivationCheckpointingConfig
    if not isinstance(raw, dict):
        raise ConfigError(f"'{SECTION}' must be an object of settings (got {raw!r})")
    try:
        model.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(validation_problems(err, model, (SECTION,))) from None
    try:
        section = model.model_validate({**raw, **{key: value for key, (_, value) in given.items()}})
    except ValidationError as err:
        raise ConfigError(
            [
                f"configure({given[item['loc'][0]][0]}=...): {item['msg']} (got {item['input']!r})"
                for item in err.errors()
            ]
        ) from None
    problems = []
    for key, field in model.model_fields.items():
        reason = model.unsupported_reason(key)
        value = getattr(section, key)
        if reason is None or value == field.default:
            continue
        if key == "number_checkpoints" and key in given:
            continue  # Megatron passes it always; as an argument it is accepted (see configure)
        where = f"configure({given[key][0]}=...)" if key in given else f"'{SECTION}.{key}'"
        problems.append(
            f"{where} is not supported ({reason}); leave it at {field.default!r} (got {value!r})"
        )
    if problems:
        raise ConfigError(problems)
    return section


def configure_from_config(section: ActivationCheckpointingConfig, mpu: Any = None) -> None:
    """Apply a validated `activation_checkpointing` section (what the engine calls at start-up).

    `mpu` is anything with the Megatron methods (`Topology` qualifies); None keeps the tensor-parallel
    group given before.
    """
    global _settings
    group, tp_rank, tp_size = _settings.group, _settings.tp_rank, _settings.tp_size
    if mpu is not None:
        group, tp_rank, tp_size = _tensor_parallel(mpu)
    _settings = _Settings(
        partition=section.partition_activations,
        cpu=section.cpu_checkpointing,
        synchronize=section.synchronize_checkpoint_boundary,
        profile=section.profile,
        group=group,
        tp_rank=tp_rank,
        tp_size=tp_size,
        configured=True,
    )
    if section.partition_activations and tp_size == 1:
        logger.warning(
            "activation checkpointing: partition_activations has no effect without tensor "
            "parallelism (the layer inputs are kept whole)"
        )
    logger.info(
        "activation checkpointing: partition_activations=%s over %d tensor-parallel rank(s), "
        "cpu_checkpointing=%s, synchronize=%s, profile=%s",
        section.partition_activations,
        tp_size,
        section.cpu_checkpointing,
        section.synchronize_checkpoint_boundary,
        section.profile,
    )


def _tensor_parallel(mpu: Any) -> tuple[Any, int, int]:
    """(group, rank, size) of an mpu's tensor-parallel group; newer Megatron names come first."""
    prefix = (
        "get_tensor_model_parallel"
        if hasattr(mpu, "get_tensor_model_parallel_group")
        else "get_model_parallel"
    )
    size = getattr(mpu, f"{prefix}_world_size")()
    if size == 1:
        return None, 0, 1
    return getattr(mpu, f"{prefix}_group")(), getattr(mpu, f"{prefix}_rank")(), size


def route_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Have a Hugging Face model's gradient checkpointing run through `checkpoint`, so that these
    settings (host memory for what is kept) apply to it: its checkpointed layers (those with
    `gradient_checkpointing` on) call their `_gradient_checkpointing_func`, which becomes
    `checkpoint`. Returns how many layers that covers; checkpointing enabled later is not routed."""
    layers = [
        module
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and hasattr(module, "_gradient_checkpointing_func")
    ]
    for module in layers:
        module._gradient_checkpointing_func = checkpoint
    return len(layers)


def is_configured() -> bool:
    """True once `configure` (or the engine) has set the settings."""
    return _settings.configured


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here (Megatron calls it after evaluation).

    What a checkpoint keeps belongs to its autograd graph and goes with it, so there is nothing to
    free; the settings stay, as in DeepSpeed.
    """


def calls() -> int:
    """How many times `checkpoint` has run in this process: the engine warns when the config asks
    for activation checkpointing and the model never calls it."""
    return _calls


# -- checkpoint ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Input:
    """What the recompute needs to rebuild a tensor input from what was kept of it."""

    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` and return its result, keeping only (what the settings keep
    of) its inputs; the activations inside are recomputed in backward."""
    global _calls
    _calls += 1
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if kwargs:
        function, args = _positional(function, args, kwargs)
    settings = _settings
    inputs = [_describe(arg, settings) for arg in args]
    kept = [_keep(arg, spec, settings) for arg, spec in zip(args, inputs)]
    # torch saves the RNG state of the devices of the tensors it is given: name them when the kept
    # tensors have moved to the host.
    devices = {a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"}
    markers = [torch.empty(0, device=d) for d in devices] if settings.cpu else []
    cuda = any(d.type == "cuda" for d in devices)
    live = [args]

    def run(*received: Any) -> Any:
        if live:  # the forward: the real inputs, so autograd links the result to them
            return function(*live.pop())
        restored = [
            _restore(value, spec, settings) for value, spec in zip(received[len(markers) :], inputs)
        ]
        return function(*restored)

    def contexts() -> tuple[_Boundary, _Boundary]:
        return (
            _Boundary("forward", settings, cuda, None),
            _Boundary("recompute", settings, cuda, _tracker.get_states()),
        )

    return _torch_checkpoint(run, *markers, *kept, use_reentrant=False, context_fn=contexts)


non_reentrant_checkpoint = checkpoint


def _positional(function: Callable, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable, tuple]:
    """Keyword arguments as trailing positional ones, so their tensors are kept like the others."""
    names, count = tuple(kwargs), len(args)

    def call(*all_args: Any) -> Any:
        return function(*all_args[:count], **dict(zip(names, all_args[count:])))

    return call, (*args, *kwargs.values())


def _describe(arg: Any, settings: _Settings) -> _Input | None:
    if not isinstance(arg, torch.Tensor):
        return None
    partitioned = (
        settings.partition and arg.is_floating_point() and arg.numel() >= settings.tp_size > 1
    )
    return _Input(arg.shape, arg.device, arg.requires_grad, partitioned)


def _keep(arg: Any, spec: _Input | None, settings: _Settings) -> Any:
    """What torch keeps of an input until the recompute: a detached alias, this rank's piece, or a
    host copy of either."""
    if spec is None:
        return arg
    kept = arg.detach()
    if spec.partitioned:
        flat = kept.reshape(-1)
        size = -(-flat.numel() // settings.tp_size)
        mine = flat[settings.tp_rank * size : (settings.tp_rank + 1) * size]
        kept = flat.new_zeros(size)  # the last ranks' pieces are padded with zeros
        kept[: mine.numel()] = mine
    if settings.cpu and kept.device.type != "cpu":
        host = torch.empty(kept.shape, dtype=kept.dtype, device="cpu", pin_memory=True)
        kept = host.copy_(kept, non_blocking=True)
    return kept


def _restore(kept: Any, spec: _Input | None, settings: _Settings) -> Any:
    if spec is None:
        return kept
    tensor = kept.to(spec.device, non_blocking=True)
    if spec.partitioned:
        whole = tensor.new_empty(tensor.numel() * settings.tp_size)
        comm.all_gather_into_tensor(whole, tensor, group=settings.group)
        tensor = whole[: spec.shape.numel()].view(spec.shape)
    return tensor.detach().requires_grad_(spec.requires_grad)


class _Boundary:
    """Around a checkpointed forward or its recompute: device synchronization, timing, and at the
    recompute the tracker's streams as they were at the forward. Reusable, since a graph kept with
    `retain_graph` recomputes once per backward."""

    def __init__(
        self, what: str, settings: _Settings, cuda: bool, tracker_states: dict | None
    ) -> None:
        self.what = what
        self.sync = cuda and (settings.synchronize or settings.profile)
        self.profile = settings.profile
        self.tracker_states = tracker_states
        self.outside: dict = {}
        self.start = 0.0

    def __enter__(self) -> None:
        if self.tracker_states is not None:
            self.outside = _tracker.get_states()
            _tracker.set_states(self.tracker_states)
        if self.sync:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.sync:
            torch.cuda.synchronize()
        if self.profile:
            elapsed = (time.perf_counter() - self.start) * 1e3
            logger.info("activation checkpoint: %s took %.3f ms", self.what, elapsed)
        if self.tracker_states is not None:
            _tracker.set_states(self.outside)


# -- random numbers --------------------------------------------------------------------------------


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named RNG streams for the device generator (the current CUDA device, or the CPU generator
    without CUDA): `fork(name)` draws from a stream and then returns to the default one.

    Megatron's tensor-parallel layers draw dropout inside `fork()`, so each tensor-parallel rank
    gets its own masks while the default stream stays the same on all of them.
    """

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self._states = {}
        self._seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """The streams' states (a copy of the mapping; states are replaced, never changed in place)."""
        return dict(self._states)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new stream `name` starting from `seed` (each name and each seed only once)."""
        if seed in self._seeds:
            raise ValueError(f"RNG seed {seed} is already used by a tracked stream")
        if name in self._states:
            raise ValueError(f"RNG stream '{name}' already exists")
        outside = _get_rng_state()
        _manual_seed(seed)
        self._states[name] = _get_rng_state()
        self._seeds.add(seed)
        _set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the default stream is left as it was."""
        if name not in self._states:
            raise ValueError(f"RNG stream '{name}' was never added (see add())")
        outside = _get_rng_state()
        _set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_rng_state()
            _set_rng_state(outside)


_tracker = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker, the one `checkpoint` restores at recompute."""
    return _tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default stream gets `seed` (the same on every tensor-parallel rank),
    the tracker's model-parallel stream `seed + 2718 + tensor-parallel rank` (different on each).
    The tensor-parallel rank is the configured mpu's (0 without one)."""
    tp_seed = seed + 2718 + _settings.tp_rank
    logger.info(
        "model-parallel RNG: default seed %d, model-parallel seed %d on tensor-parallel rank %d",
        seed,
        tp_seed,
        _settings.tp_rank,
    )
    _tracker.reset()
    _manual_seed(seed)
    _tracker.add(MODEL_PARALLEL_RNG, tp_seed)
