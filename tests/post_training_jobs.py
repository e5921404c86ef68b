"""TRL runs on shardspeed, for `test_post_training.py`:

    SHARDSPEED_AS_DEEPSPEED=1 torchrun --nproc_per_node 2 tests/post_training_jobs.py OUT CASE ...

As in `hf_jobs.py`, the code is what a user writes: TRL's trainers with a DeepSpeed config, the
`deepspeed` import resolving to shardspeed. The tiny Llama and its start weights are
`hf_jobs`'s; the tokenizer is a word-level one over the token ids written as words, built here
(nothing is downloaded). Each run is compared with the same trainer without DeepSpeed (DDP over
gloo) given the optimizer and schedule the DeepSpeed config makes (AdamW, DeepSpeed's WarmupLR as
`hf_jobs.warmup_schedule`), fp32 (TRL's configs default to bf16, which DDP runs as autocast and
DeepSpeed as bf16 weights). Rank 0 writes `OUT/<case>-ws<world>.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import hf_jobs
from hf_jobs import (
    LR,
    VOCAB,
    ZERO2,
    ZERO3,
    full_parameters,
    rank,
    warmup_schedule,
    with_stage,
    world,
)

STEPS = 5  # DeepSpeed's WarmupLR as the configs fill it keeps the first two updates at lr 0
CASES: dict[str, Any] = {}


def case(fn: Any) -> Any:
    CASES[fn.__name__] = fn
    return fn


def tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word "i"; 0 pads, 1 ends a sequence."""
    words = Tokenizer(WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="0", eos_token="1", unk_token="0"
    )


def words(n: int, length: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, length), generator=gen)
    return [" ".join(str(i) for i in row.tolist()) for row in ids]


def trl_settings(out: Path, ds: dict | None, **extra: Any) -> dict[str, Any]:
    hf_jobs.reset(cpu=ds is None)
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "max_steps": STEPS,
        "learning_rate": LR,
        "weight_decay": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "bf16": False,
        "deepspeed": json.loads(json.dumps(ds)) if ds is not None else None,
        **extra,
    }


def run(trainer_class: Any, config_class: Any, out: Path, ds: dict | None, **kwargs: Any) -> dict:
    """Train; the logged losses (and rewards, for GRPO) and the whole trained weights."""
    settings = kwargs.pop("settings", {})
    args = config_class(**trl_settings(out, ds, **settings))
    model = AutoModelForCausalLM.from_pretrained(hf_jobs.pretrained(hf_jobs.OUT))
    optimizers = (None, None)
    if ds is None:  # what the DeepSpeed config builds, for the run without it
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        optimizers = (optimizer, warmup_schedule(optimizer))
    trainer = trainer_class(
        model=model, args=args, processing_class=tokenizer(), optimizers=optimizers, **kwargs
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    weights = full_parameters(trainer.accelerator.unwrap_model(engine))
    trainer.save_model(out / "saved")
    saved = load_file(out / "saved" / "model.safetensors") if rank() == 0 else {}
    return {
        "losses": [entry["loss"] for entry in logged],
        "rewards": [entry.get("reward") for entry in logged],
        "engine": type(engine).__module__ + "." + type(engine).__name__,
        "saved_vs_trained": max((saved[n] - weights[n]).abs().max().item() for n in saved)
        if saved
        else 0.0,
        "weights": weights,
    }


def compare(name: str, runs: dict[str, dict], reference: dict) -> None:
    """Each run against the reference: losses, rewards, the largest weight difference."""
    result = {"reference_losses": reference["losses"], "reference_rewards": reference["rewards"]}
    for key, ours in runs.items():
        weights = ours.pop("weights")
        ours["relative_difference"] = max(
            ((weights[n] - w).norm() / w.norm()).item() for n, w in reference["weights"].items()
        )
        result[key] = ours
    if rank() == 0:
        (hf_jobs.OUT / f"{name}-ws{world()}.json").write_text(json.dumps(result))


def against_reference(
    name: str,
    trainer_class: Any,
    config_class: Any,
    out: Path,
    stages: tuple = ((2, ZERO2), (3, ZERO3)),
    **kwargs: Any,
) -> None:
    """The trainer without DeepSpeed, then at each (stage, documented config); compared."""
    reference = run(trainer_class, config_class, out / name, None, **kwargs)
    runs = {
        f"zero{stage}": run(
            trainer_class, config_class, out / f"{name}{stage}", with_stage(config, stage), **kwargs
        )
        for stage, config in stages
    }
    compare(name, runs, reference)


@case
def trl_sft(out: Path) -> None:
    """SFTTrainer on token-id sentences at ZeRO 2 and 3 against the same trainer without."""
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": words(32, 15, seed=1)})
    against_reference("trl_sft", SFTTrainer, SFTConfig, out, train_dataset=data)


@case
def trl_grpo(out: Path) -> None:
    """GRPOTrainer with in-process generation at ZeRO 3 (TRL gathers the weights and takes the
    stage-3 hooks off while it generates) against the same trainer without DeepSpeed; the reward
    is the completion's length, so the rewards follow the sampled tokens."""
    from trl import GRPOConfig, GRPOTrainer

    def length(completions: list[str], **kwargs: Any) -> list[float]:
        return [len(c.split()) / 10 for c in completions]

    data = Dataset.from_dict({"prompt": words(16, 6, seed=2)})
    settings = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 6}
    kwargs = {"reward_funcs": length, "train_dataset": data, "settings": settings}
    against_reference("trl_grpo", GRPOTrainer, GRPOConfig, out, stages=((3, ZERO3),), **kwargs)


@case
def trl_dpo(out: Path) -> None:
    """DPOTrainer at ZeRO 2 and 3 against the same trainer without DeepSpeed; the frozen reference
    model is TRL's own copy, which it hands to `deepspeed.initialize` without an optimizer."""
    from trl import DPOConfig, DPOTrainer

    prompts, chosen, rejected = words(16, 4, seed=3), words(16, 5, seed=4), words(16, 5, seed=5)
    data = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    against_reference("trl_dpo", DPOTrainer, DPOConfig, out, train_dataset=data)


def lora_trainer(out: Path, ds: dict | None, **overrides: Any) -> Any:
    """transformers' Trainer on a PEFT LoRA model (rank 4 on q_proj and v_proj of the tiny Llama;
    the base frozen); without `ds`, the AdamW and WarmupLR-shaped schedule the configs make."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**trl_settings(out, ds, **overrides))
    torch.manual_seed(0)  # the adapters' initial values
    base = AutoModelForCausalLM.from_pretrained(hf_jobs.pretrained(hf_jobs.OUT))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    optimizers = (None, None)
    if ds is None:
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0
        )
        optimizers = (optimizer, warmup_schedule(optimizer))
    data = [{"input_ids": x["input_ids"], "labels": x["labels"]} for x in hf_jobs.dataset()]
    return Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers)


def lora_result(trainer: Any) -> dict:
    """Losses, adapters, the merged weights, and how far the frozen base moved."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    whole = full_parameters(model)
    adapters = {n: w for n, w in whole.items() if "lora_" in n}
    start = load_file(hf_jobs.pretrained(hf_jobs.OUT) / "model.safetensors")
    base = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): w for n, w in whole.items()
    }
    moved = max((base[n] - w).abs().max().item() for n, w in start.items() if n in base)
    merged = {}
    for name, weight in base.items():
        if "lora_" in name:
            continue
        prefix = name.removesuffix(".weight")
        a, b = (f"base_model.model.{prefix}.lora_{x}.default.weight" for x in "AB")
        merged[name] = weight + (whole[b] @ whole[a]) * 2.0 if a in whole else weight
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "base_moved": moved,
        "adapters": adapters,
        "merged": merged,
    }


@case
def peft_lora(out: Path) -> None:
    """PEFT LoRA through Trainer at ZeRO 2 and 3 against the same without DeepSpeed: losses,
    adapters and the merged model (W + B A * alpha / r); the frozen base does not move. At ZeRO 3
    also: save_model writes the adapters only, and a run saved at step 2 (checkpoints without the
    frozen base: exclude_frozen_parameters) and resumed ends where the uninterrupted run ends."""
    reference = lora_trainer(out / "lora", None)
    reference.train()
    want = lora_result(reference)
    result: dict[str, Any] = {"reference_losses": want["losses"]}
    for stage, config in ((2, ZERO2), (3, ZERO3)):
        saving = {"save_strategy": "steps", "save_steps": 2} if stage == 3 else {}
        trainer = lora_trainer(out / f"lora{stage}", with_stage(config, stage), **saving)
        trainer.train()
        got = lora_result(trainer)
        trainer.save_model(out / f"lora{stage}_saved")
        torch.distributed.barrier()  # rank 0 writes the files
        entry = {
            "losses": got["losses"],
            "trainable": got["trainable"] == want["trainable"] and len(got["trainable"]) == 8,
            "base_moved": got["base_moved"],
            "adapters": hf_jobs.max_difference(got["adapters"], want["adapters"]),
            "merged": hf_jobs.max_difference(got["merged"], want["merged"]),
            "saved_files": sorted(p.name for p in (out / f"lora{stage}_saved").iterdir()),
        }
        if stage == 3:
            resumed = lora_trainer(out / "lora3_resumed", with_stage(config, stage), **saving)
            resumed.train(resume_from_checkpoint=str(out / "lora3" / "checkpoint-2"))
            entry["resumed_vs_uninterrupted"] = hf_jobs.max_difference(
                lora_result(resumed)["adapters"], got["adapters"]
            )
            checkpoint = out / "lora3" / "checkpoint-2"
            tensors = list((checkpoint / "global_step2").glob("*.safetensors"))
            entry["checkpoint_bytes"] = sum(f.stat().st_size for f in tensors)
            entry["base_bytes"] = (
                (hf_jobs.pretrained(hf_jobs.OUT) / "model.safetensors").stat().st_size
            )
            entry["checkpoint_files"] = sorted(
                str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()
            )
        result[f"zero{stage}"] = entry
    if rank() == 0:
        (hf_jobs.OUT / f"peft_lora-ws{world()}.json").write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    hf_jobs.OUT = Path(argv[0])
    hf_jobs.OUT.mkdir(parents=True, exist_ok=True)
    hf_jobs.reset()
    for name in argv[1:]:
        CASES[name](hf_jobs.OUT)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
