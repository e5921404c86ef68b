"""The checkpoint room: a pickle-free format (safetensors plus a JSON manifest) that any world size
and ZeRO stage can read, crash-safe saves, and consolidation into one state dict."""

from .engine_state import load_engine, save_engine
from .format import CheckpointError

__all__ = ["CheckpointError", "load_engine", "save_engine"]
