"""`shardspeed.profiling` (DeepSpeed's `deepspeed.profiling`): see docs/profiling.md.

`flops_profiler` counts each module's parameters, FLOPs and forward latency over a profiled step.
"""
