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


class _HostMemory:
    """Memory figures of a CPU process: its resident set, as DeepSpeed's CPU accelerator reports."""

    def __init__(self) -> None:
        self._peak_rss = 0

    def get_rss(self) -> int:
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def reset_rss(self) -> int:
        self._peak_rss = _rss()
        return self._peak_rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self.get_rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self.get_rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self.get_rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        rss = self.get_rss()
        return {
            "allocated_bytes.all.current": rss,
            "allocated_bytes.all.peak": self._peak_rss,
            "reserved_bytes.all.current": rss,
            "reserved_bytes.all.peak": self._peak_rss,
        }

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def empty_cache(self) -> None:
        pass

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False


class _CudaMemory(_HostMemory):
    """torch.cuda's caching allocator figures."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


class _HostStreams:
    """Ordering on a synchronous device: streams, events, graphs and ranges that cost nothing."""

    Stream = _NullStream
    Event = _NullEvent

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return _NullStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return _NullStream()

    def create_graph(self) -> Any:
        return None

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        pass

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        pass

    def range_pop(self, domain: Any = None) -> None:
        pass


class _CudaStreams(_HostStreams):
    """torch.cuda's streams, events, CUDA graphs and NVTX ranges."""

    Stream = torch.cuda.Stream
    Event = torch.cuda.Event

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if hasattr(torch.cuda, "nvtx"):
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if hasattr(torch.cuda, "nvtx"):
            torch.cuda.nvtx.range_pop()


class _HostRandom:
    """The CPU generator's seed and state."""

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator


class _CudaRandom(_HostRandom):
    """Each GPU's generator."""

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]


class _Builds:
    """Compiled ops (DeepSpeed builds C++/CUDA extensions; shardspeed has none) and torch.compile."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._compile_backend = "inductor"

    def op_builder_dir(self) -> str:
        return "shardspeed.ops"

    def create_op_builder(self, op_name: str) -> None:
        return None

    def get_op_builder(self, class_name: str) -> None:
        return None

    def build_extension(self) -> type:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def is_triton_supported(self) -> bool:
        if not self._cuda or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability()[0] >= 8

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


# DeepSpeed's second names for one answer.
_SAME_AS = {
    "use_host_timers": "is_synchronized_device",
    "resolves_data_dependency": "is_synchronized_device",
    "handles_memory_backpressure": "is_synchronized_device",
    "memory_cached": "memory_reserved",
    "max_memory_cached": "max_memory_reserved",
    "reset_max_memory_cached": "reset_max_memory_allocated",
    "reset_peak_memory_stats": "reset_max_memory_allocated",
}

# DeepSpeed's legacy tensor types (`get_accelerator().FloatTensor([...])`): a constructor per dtype.
_TENSOR_TYPES = {
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32,
    "HalfTensor": torch.float16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
}


class Accelerator:
    """DeepSpeed's accelerator interface for one device kind, `cuda` or `cpu`.

    The device's identity is answered here; memory, streams, random state and builds are parts
    chosen once for the kind, and their methods are this object's methods under DeepSpeed's names.
    """

    def __init__(self, name: str) -> None:
        if name not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"accelerator {name!r} is not supported; shardspeed runs on "
                f"{' or '.join(SUPPORTED_ACCELERATORS)} (set DS_ACCELERATOR to one of them)"
            )
        self._name = name
        self._cuda = name == "cuda"
        self._communication_backend_name = "nccl" if self._cuda else "gloo"
        self._parts = (
            _CudaMemory() if self._cuda else _HostMemory(),
            _CudaStreams() if self._cuda else _HostStreams(),
            _CudaRandom() if self._cuda else _HostRandom(),
            _Builds(self._cuda),
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _TENSOR_TYPES:
            return self._tensor_type(_TENSOR_TYPES[name])
        name = _SAME_AS.get(name, name)
        if name in type(self).__dict__:
            return getattr(self, name)
        for part in self._parts:
            if hasattr(type(part), name):
                return getattr(part, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        parts = (name for part in self._parts for name in dir(part) if not name.startswith("_"))
        return sorted({*super().__dir__(), *parts, *_SAME_AS, *_TENSOR_TYPES})

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    def is_synchronized_device(self) -> bool:
        return not self._cuda

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

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self._name

        def build(*data: Any) -> torch.Tensor:
            return torch.tensor(data[0] if data else [], dtype=dtype, device=device)

        return build


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
