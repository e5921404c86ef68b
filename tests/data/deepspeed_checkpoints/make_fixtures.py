"""Make the DeepSpeed checkpoints `tests/test_deepspeed_checkpoints.py` reads, with DeepSpeed itself.

Run with DeepSpeed 0.19.8 installed (it is not a test dependency), on CPU:

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu python tests/data/deepspeed_checkpoints/make_fixtures.py

For each case it starts `torchrun` on the case's processes: DeepSpeed trains a small MLP three steps
on fixed batches, saves a checkpoint (`<case>/global_step3/`, `<case>/latest`), trains two more
steps and rank 0 writes the parameters it ends with (`<case>/continued.safetensors`): what a
resumed run must reproduce. `universal` converts the `z2_fp32_ws2` checkpoint with DeepSpeed's
`ds_to_universal`. `trainer_z*` are Hugging Face Trainer output folders of DeepSpeed runs (a tiny
Llama, `checkpoint-2/` with `global_step2/`) and the weights the uninterrupted 4-step run ends with.
DeepSpeed's copied recovery scripts (`zero_to_fp32.py`, `zero_to_torch.py`) are not kept. There is
no fp16 case: DeepSpeed refuses fp16 on a CPU ("Type fp16 is not supported on your device").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LR, STEPS_SAVED, STEPS_MORE = 0.01, 3, 2

# name: (ZeRO stage, precision, processes, pipeline stages)
CASES = {
    "z0_fp32_ws1": (0, "fp32", 1, 1),
    "z0_fp32_ws2": (0, "fp32", 2, 1),
    "z1_fp32_ws2": (1, "fp32", 2, 1),
    "z2_fp32_ws1": (2, "fp32", 1, 1),
    "z2_fp32_ws2": (2, "fp32", 2, 1),
    "z3_fp32_ws1": (3, "fp32", 1, 1),
    "z3_fp32_ws2": (3, "fp32", 2, 1),
    "z2_bf16_ws2": (2, "bf16", 2, 1),
    "z3_bf16_ws2": (3, "bf16", 2, 1),
    "pipe2_z1_fp32_ws2": (1, "fp32", 2, 2),
}


def config(stage: int, precision: str, world: int, stages: int) -> dict:
    """The config every case trains with (the test loads with the same, at other sizes)."""
    dp = world // stages
    out = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8 // dp if stages == 1 else 4 // dp,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 3, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
    }
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    return out


def batch(step: int):
    """The global batch of `step`: 8 samples, the same whatever the number of processes."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def layers():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]


def worker(name: str) -> None:
    import deepspeed
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch import nn

    stages = CASES[name][3]
    deepspeed.init_distributed()
    out = HERE / name
    if stages > 1:
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(
            layers(), num_stages=stages, loss_fn=F.mse_loss, partition_method="uniform"
        )
    else:
        model = nn.Sequential(*layers())
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(*CASES[name])
    )
    dtype = next(engine.module.parameters()).dtype
    rank, dp = engine.global_rank, engine.dp_world_size
    for step in range(STEPS_SAVED + STEPS_MORE):
        if step == STEPS_SAVED:
            # ds_to_universal wants this key, which Megatron-DeepSpeed writes (empty here, as in
            # DeepSpeed's own universal checkpoint tests).
            engine.save_checkpoint(str(out), client_state={"universal_checkpoint_info": {}})
        x, y = batch(step)
        if stages > 1:
            micro = engine.train_micro_batch_size_per_gpu()
            mine = engine.grid.get_data_parallel_rank()
            pieces = [
                (
                    x[(m * dp + mine) * micro :][:micro].to(dtype),
                    y[(m * dp + mine) * micro :][:micro],
                )
                for m in range(engine.gradient_accumulation_steps())
            ]
            engine.train_batch(iter(pieces))
            continue
        micro = 8 // dp
        xs, ys = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        loss = F.mse_loss(engine(xs.to(dtype)).float(), ys)
        engine.backward(loss)
        engine.step()
    params = {}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            params[n] = p.detach().float().clone().contiguous()
    if stages > 1:  # each stage holds its own layers: gather the names on rank 0
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, params)
        params = {k: v for part in gathered for k, v in part.items()}
    if torch.distributed.get_rank() == 0:
        save_file(params, str(out / "continued.safetensors"))


def trainer_worker(stage: int) -> None:
    """A Hugging Face Trainer run under DeepSpeed that saves at step 2 and stops at step 4."""
    import torch
    from accelerate import PartialState
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    PartialState(backend="gloo")
    out = HERE / f"trainer_z{stage}"
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": stage},
    }
    args = TrainingArguments(
        output_dir=str(out),
        deepspeed=ds,
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(trainer_model_config(LlamaConfig))
    trainer = Trainer(model=model, args=args, train_dataset=trainer_dataset())
    trainer.train()
    final = {}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for n, p in model.named_parameters():
            final[n] = p.detach().float().clone().contiguous()
    if torch.distributed.get_rank() == 0:
        save_file(final, str(out / "final.safetensors"))
        (out / "losses.json").write_text(
            json.dumps([e["loss"] for e in trainer.state.log_history if "loss" in e])
        )


def trainer_model_config(config_class):
    return config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def trainer_dataset():
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (64, 16), generator=gen)
    return [{"input_ids": x, "labels": x} for x in ids]


def launch(processes: int, *args: str) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        __file__,
        *args,
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true"}
    subprocess.run(command, check=True, env=env)


def tidy(directory: Path) -> None:
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        for path in directory.rglob(script):
            path.unlink()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        worker(sys.argv[2])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        trainer_worker(int(sys.argv[2]))
        return
    import deepspeed

    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    for name, (_, _, world, _) in CASES.items():
        shutil.rmtree(HERE / name, ignore_errors=True)
        launch(world, "--case", name)
        tidy(HERE / name)
    universal = HERE / "universal"
    shutil.rmtree(universal, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(HERE / "z2_fp32_ws2" / "global_step3"),
            "--output_folder",
            str(universal / "global_step3_universal"),
        ],
        check=True,
    )
    (universal / "latest_universal").write_text("global_step3_universal")
    shutil.copy(HERE / "z2_fp32_ws2" / "continued.safetensors", universal / "continued.safetensors")
    for stage in (2, 3):
        shutil.rmtree(HERE / f"trainer_z{stage}", ignore_errors=True)
        launch(2, "--trainer", str(stage))
        out = HERE / f"trainer_z{stage}"
        for extra in ("checkpoint-4", "runs"):
            shutil.rmtree(out / extra, ignore_errors=True)
        tidy(out)
    manifest = {
        name: dict(zip(("stage", "precision", "world", "pipeline_stages"), spec))
        for name, spec in CASES.items()
    }
    (HERE / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
