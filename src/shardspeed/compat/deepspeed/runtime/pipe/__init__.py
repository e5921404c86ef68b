"""Modules of DeepSpeed's `deepspeed.runtime.pipe` with no room of their own in `shardspeed.pipe`."""

__all__: list[str] = []
