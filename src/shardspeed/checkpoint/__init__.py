"""The checkpoint room: a pickle-free format (safetensors plus a JSON manifest) that any world size
and ZeRO stage can read, crash-safe saves, and consolidation into one state dict."""

from .engine_state import load_engine, load_parameters, open_checkpoint, resolve_tag, save_engine
from .format import CheckpointError, verify_files
from .hf import hf_source, load_hf_weights

__all__ = [
    "CheckpointError",
    "hf_source",
    "load_engine",
    "load_hf_weights",
    "load_parameters",
    "open_checkpoint",
    "resolve_tag",
    "save_engine",
    "verify_files",
]
