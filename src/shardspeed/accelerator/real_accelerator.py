"""The device a process trains on, behind DeepSpeed's accelerator interface (`get_accelerator()`).

DeepSpeed routes every device question through one object: its name and index, streams and events,
random state, memory statistics, the dtypes it supports, the communication backend that suits it.
Libraries built on DeepSpeed (transformers, accelerate, TRL) and user scripts call it, and so does
shardspeed itself (the engine's device, the default process-group backend). Two kinds exist: `cuda`
(torch.cuda) and `cpu`. `DS_ACCELERATOR=cpu|cuda` chooses; otherwise CUDA when torch sees a GPU.

On the CPU there are no streams or caches: those calls do what a synchronous device implies
(synchronize returns at once, a stream is a no-op context), and memory figures are the process's
resident set, as DeepSpeed's CPU accelerator reports them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "Accelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

SUPPORTED_ACCELERATORS = ("cuda", "cpu")


class _NullStream:
    """The CPU's stand-in for a stream: work is already ordered, so waiting is free."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NullEvent()

    def query(self) -> bool:
        return True


class _NullEvent:
    """The CPU's stand-in for an event: recorded work has always finished."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        del enable_timing, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        del stream

    def query(self) -> bool:
        return True


def _rss() -> int:
    """This process's resident memory in bytes (what a CPU's 'memory allocated' is)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Accelerator:
    """DeepSpeed's accelerator interface for one device kind, `cuda` or `cpu`."""

    def __init__(self, name: str) -> None:
        if name not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"accelerator {name!r} is not supported; shardspeed runs on "
                f"{' or '.join(SUPPORTED_ACCELERATORS)} (set DS_ACCELERATOR to one of them)"
            )
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"
        self._compile_backend = "inductor"
        self._peak_rss = 0

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # -- identity -------------------------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        if self._cuda:
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        # DeepSpeed counts CPU "devices" as the ranks one node runs.
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        if self._cuda:
            return torch.cuda._lazy_call(callback)
        return callback()

    # -- random state ---------------------------------------------------------------------------

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        if self._cuda:
            return torch.cuda.default_generators[device_index]
        return torch.default_generator

    # -- streams, events, graphs ----------------------------------------------------------------

    @property
    def Stream(self) -> type:
        return torch.cuda.Stream if self._cuda else _NullStream

    @property
    def Event(self) -> type:
        return torch.cuda.Event if self._cuda else _NullEvent

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else _NullStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else _NullStream()

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager:
        if self._cuda:
            return torch.cuda.graph(graph, pool, stream)
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        if self._cuda:
            graph.replay()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        del domain, category
        if self._cuda and hasattr(torch.cuda, "nvtx"):
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        del domain
        if self._cuda and hasattr(torch.cuda, "nvtx"):
            torch.cuda.nvtx.range_pop()

    # -- memory ---------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def get_rss(self) -> int:
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def reset_rss(self) -> int:
        self._peak_rss = _rss()
        return self._peak_rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self.get_rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self.get_rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self.reset_rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.get_rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        rss = self.get_rss()
        return {
            "allocated_bytes.all.current": rss,
            "allocated_bytes.all.peak": self._peak_rss,
            "reserved_bytes.all.current": rss,
            "reserved_bytes.all.peak": self._peak_rss,
        }

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        del align_bytes
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    # -- dtypes ---------------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # torch computes in fp16 on both (slowly on a CPU)

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_triton_supported(self) -> bool:
        if not self._cuda or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability()[0] >= 8

    def _tensor_class(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self._name

        def build(*data: Any) -> torch.Tensor:
            return torch.tensor(data[0] if data else [], dtype=dtype, device=device)

        return build

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_class(torch.int64)

    # -- compiled ops and torch.compile ----------------------------------------------------------

    def op_builder_dir(self) -> str:
        return "shardspeed.ops"

    def create_op_builder(self, op_name: str) -> None:
        """DeepSpeed builds C++/CUDA extensions here; shardspeed has none to build."""
        del op_name
        return None

    def get_op_builder(self, class_name: str) -> None:
        del class_name
        return None

    def build_extension(self) -> type:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        import torch._dynamo

        if backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(
                f"{backend!r} is not a torch.compile backend; available: "
                f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}"
            )
        self._compile_backend = backend


_accelerator: Accelerator | None = None


def _chosen_name() -> str:
    name = os.environ.get("DS_ACCELERATOR")
    if name is not None:
        if name not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"DS_ACCELERATOR={name!r} is not supported; shardspeed runs on "
                f"{' or '.join(SUPPORTED_ACCELERATORS)}"
            )
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR=cuda, but torch sees no CUDA device here")
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """The process's accelerator, chosen once (DS_ACCELERATOR, else CUDA if present, else CPU)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator(_chosen_name())
    return _accelerator


def set_accelerator(accelerator: Accelerator) -> None:
    """Use `accelerator` from now on (DeepSpeed's way to force a device kind)."""
    global _accelerator
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator() takes an Accelerator, not {type(accelerator).__name__}")
    _accelerator = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED_ACCELERATORS
