"""DeepSpeed's `deepspeed.ops` optimizer names, built on torch (no compiled extensions)."""
