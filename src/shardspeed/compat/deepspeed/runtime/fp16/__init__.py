"""DeepSpeed's `deepspeed.runtime.fp16`: its 16-bit optimizer wrapper names and loss scalers."""

__all__: list[str] = []
