"""Small helpers every room may use: this room imports nothing of shardspeed's and no torch.

`net`: free local ports for rendezvous; `z3_leaf_module`: DeepSpeed's ZeRO-3 leaf-module flag;
`observer`: the engine's hook points; `views`: DeepSpeed class names answered by `isinstance`.
`shardspeed.utils`, DeepSpeed's `deepspeed.utils`, re-exports what users call from here.
"""
