"""Writes the DeepSpeed AutoEP checkpoint fixtures under tests/data/deepspeed_autoep/ with DeepSpeed
0.19.8 and transformers 5.15.1 (the release its AutoEP works with), on 2 CPU ranks: the tiny
Qwen3-MoE of tests/moe_families.py at autoep_size 2, ZeRO 2 (tag autoep_zero2) and ZeRO 3 (tag
autoep_zero3, AutoEP's partition-native expert files), after 2 AdamW steps of the tests' global
batches (the tests compare its resumed run with one process trained on the same batches).

    DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run --nproc_per_node 2 \\
        tests/data/make_deepspeed_autoep.py [2|3]
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from moe_families import MICRO, build, global_batch  # noqa: E402

OUT = HERE / "deepspeed_autoep"
STEPS, LR = 2, 1e-2


def main(stage: int) -> None:
    deepspeed.init_distributed("gloo")
    torch.set_num_threads(1)
    model = build("qwen3_moe")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank = dist.get_rank()
    for step in range(STEPS):
        ids = global_batch(step, 2)[rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(OUT), tag=f"autoep_zero{stage}")
    if rank == 0:  # DeepSpeed's own conversion scripts, copied beside every checkpoint
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (OUT / script).unlink(missing_ok=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
