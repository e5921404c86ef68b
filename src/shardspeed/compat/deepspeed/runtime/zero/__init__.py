"""DeepSpeed's `deepspeed.runtime.zero` modules that are adapters over `shardspeed.zero` and the config."""

__all__: list[str] = []
