"""DeepSpeed's `deepspeed.ops.aio`: the asynchronous I/O op's builder. shardspeed's NVMe offload
(`shardspeed.zero.swap`, a thread pool over O_DIRECT files) does that op's work in torch and
Python, so the builder says it is compatible; transformers' NVMe tests ask it before running."""

from ..op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
