"""DeepSpeed's `deepspeed.module_inject`: what RLHF frameworks import of it (OpenRLHF gathers
automatic tensor parallelism's split layers with `layers.GatherReplacedLayerParams`)."""
