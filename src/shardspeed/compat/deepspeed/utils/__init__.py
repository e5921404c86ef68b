"""Modules of DeepSpeed's `deepspeed.utils` that shardspeed.utils has no module for."""

__all__: list[str] = []
