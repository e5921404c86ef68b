"""Modules of DeepSpeed's `deepspeed.runtime` that are adapters here (config, optimizer names, ...)."""

__all__: list[str] = []
