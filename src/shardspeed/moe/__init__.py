"""`shardspeed.moe` (DeepSpeed's `deepspeed.moe`): mixture of experts.

So far: the gate (`gating.TopKGate`: top-1 and top-2 routing, capacity and token dropping, noisy
gating, random token selection, the load-balancing loss, and beyond DeepSpeed a temperature and
per-expert load factors) and `layer.MoE` with every expert on every rank. Expert parallelism
(`ep_size` > 1) is issue 9's next part and refused until then.
"""
