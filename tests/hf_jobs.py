"""Hugging Face Trainer and accelerate runs on shardspeed, for `test_huggingface.py`.

    SHARDSPEED_AS_DEEPSPEED=1 torchrun --nproc_per_node N tests/hf_jobs.py OUT CASE [CASE ...]
    (a CASE may be one of post_training_jobs.py's)
    SHARDSPEED_AS_DEEPSPEED=1 accelerate launch --use_deepspeed ... tests/hf_jobs.py OUT CASE

The code here is what a user writes: it imports transformers and accelerate, and `deepspeed` only
where a user would (the switch makes it resolve to shardspeed). Each case trains a tiny Llama built
from a config (nothing downloaded) on synthetic token ids for a few steps; rank 0 writes
`OUT/<case>-ws<world size>.json`. Cases run one after another in one process, accelerate's
process-wide state reset between them (as accelerate's own tests do), since starting processes and
importing transformers costs far more than a case.

A DeepSpeed run's reference is the same Trainer without DeepSpeed (DDP over gloo) with the same
optimizer and schedule: the configs say `"scheduler": WarmupLR` with Hugging Face's "auto" values,
which the reference gets as a torch LambdaLR.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.state import AcceleratorState
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

VOCAB, SEQ, SAMPLES, STEPS, LR = 64, 16, 64, 4, 1e-3

# Hugging Face's documented configs (its DeepSpeed guide's ZeRO-2 and ZeRO-3 examples), "auto" and
# all, as the worked example ships them.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FIXTURES = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"
ZERO2 = json.loads((EXAMPLES / "hf_zero2.json").read_text())
ZERO3 = json.loads((EXAMPLES / "hf_zero3.json").read_text())

CASES: dict[str, Any] = {}
_references: dict[str, Trainer] = {}


def case(fn: Any) -> Any:
    CASES[fn.__name__] = fn
    return fn


def rank() -> int:
    return torch.distributed.get_rank()


def world() -> int:
    return torch.distributed.get_world_size()


def with_stage(config: dict, stage: int, **zero: Any) -> dict:
    """`config` (a documented one) at another ZeRO stage, or with more zero_optimization keys."""
    section = {"stage": stage} if stage < 2 else {**config["zero_optimization"], "stage": stage}
    return {**config, "zero_optimization": {**section, **zero}}


def dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    return [{"input_ids": x, "labels": x} for x in ids]


def reset(cpu: bool = False) -> None:
    """Forget accelerate's process-wide state (the process group stays), transformers' DeepSpeed
    config and the switch TrainingArguments(deepspeed=...) sets for accelerate; then what a
    CPU-only machine needs before TrainingArguments or Accelerator (`cpu` for a DDP run: without
    it accelerate does not distribute over CPU processes)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    gc.collect()
    PartialState(cpu=cpu, backend="gloo")


def training_args(out: Path, ds: dict | None, **overrides: Any) -> TrainingArguments:
    reset()
    settings = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": STEPS,
        "learning_rate": LR,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": 0,
        "disable_tqdm": True,
        "use_cpu": True,
        "deepspeed": json.loads(json.dumps(ds)) if ds is not None else None,
        **overrides,
    }
    return TrainingArguments(**settings)


def warmup_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """DeepSpeed's WarmupLR as the "auto" values fill it (0 to the lr over 2 steps, log curve),
    as a LambdaLR. WarmupLR writes the minimum lr when it is built and counts its first step as
    iteration 0, so update k (from 0) runs at the lr of iteration k - 1: 0, 0, then the full lr."""

    def factor(update: int) -> float:
        iteration = update - 1
        if iteration < 0:
            return 0.0
        return math.log(iteration + 1) / math.log(2) if iteration < 2 else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pretrained(out: Path) -> Path:
    """A model saved once by rank 0: the start of every run (the ZeRO-3 loading path reads it)."""
    path = out / "pretrained"
    if rank() == 0 and not path.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config()).save_pretrained(path)
    torch.distributed.barrier()
    return path


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (gathered under ZeRO-3; collective)."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def plain(out: Path, start: dict[str, torch.Tensor] | None = None, **overrides: Any) -> Trainer:
    """The reference: the same Trainer without DeepSpeed, same optimizer and schedule."""
    key = json.dumps(sorted(overrides.items()))
    if start is None and key in _references:
        return _references[key]
    args = training_args(out / "plain", None, **overrides)
    model = AutoModelForCausalLM.from_pretrained(pretrained(out))
    if start is not None:
        model.load_state_dict(start, strict=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset()[:8],
        optimizers=(optimizer, warmup_schedule(optimizer)),
    )
    trainer.train()
    trainer.final_eval_loss = trainer.evaluate()["eval_loss"]
    if start is None:
        _references[key] = trainer
    return trainer


def deepspeed_trainer(out: Path, ds: dict, model: Any = None, **overrides: Any) -> Trainer:
    args = training_args(out, ds, **overrides)
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(pretrained(out))
    return Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset()[:8])


def record(out: Path, name: str, trainer: Trainer, reference: Trainer, **extra: Any) -> None:
    engine = trainer.model_wrapped
    result = {
        "lrs": [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry],
        "reference_lrs": [e["learning_rate"] for e in reference.state.log_history if "loss" in e],
        "losses": losses(trainer),
        "reference_losses": losses(reference),
        "global_steps": engine.global_steps,
        "engine": type(engine).__module__ + "." + type(engine).__name__,
        "zero_stage": engine.config.get("zero_optimization", {}).get("stage"),
        **extra,
    }
    if rank() == 0:
        (out / f"{name}-ws{world()}.json").write_text(json.dumps(result))


# -- Trainer -------------------------------------------------------------------------------------


@case
def trainer_stages(out: Path) -> None:
    """ZeRO 0, 1 and 2 (the documented ZeRO-2 config, its stage changed) against the reference."""
    reference = plain(out)
    for stage in (0, 1, 2):
        trainer = deepspeed_trainer(out / f"z{stage}", with_stage(ZERO2, stage))
        trainer.train()
        record(out, f"trainer_zero{stage}", trainer, reference)


@case
def trainer_expert_parallel(out: Path) -> None:
    """A Qwen3-MoE model through Trainer with the documented ZeRO-2 config plus DeepSpeed's
    `expert_parallel` section (autoep_size 2): losses and final weights against the same Trainer
    without DeepSpeed, which runs every expert on every rank."""
    from moe_families import family_config

    reset()  # an earlier case's ZeRO-3 config would build the model under zero.Init
    path = out / "pretrained_moe"
    if rank() == 0 and not path.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(family_config("qwen3_moe")).save_pretrained(path)
    torch.distributed.barrier()
    reference_args = training_args(out / "moe_plain", None)
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    reference = Trainer(
        model=model,
        args=reference_args,
        train_dataset=dataset(),
        optimizers=(optimizer, warmup_schedule(optimizer)),
    )
    reference.train()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = {**ZERO2, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    trainer = deepspeed_trainer(out / "moe_ep", ds, AutoModelForCausalLM.from_pretrained(path))
    trainer.train()
    engine = trainer.model_wrapped
    trained = engine._zero3_consolidated_16bit_state_dict()  # rank 0's, whole (collective)
    difference = (
        max(((trained[n] - v).norm() / v.norm()).item() for n, v in expected.items())
        if trained is not None
        else None
    )
    experts = engine.module.model.layers[0].mlp.experts
    trainer.save_model(out / "moe_ep_saved")  # model.state_dict() on every rank, experts whole
    if trained is not None:
        save_file(
            {n: t.contiguous() for n, t in trained.items()}, out / "moe_ep_trained.safetensors"
        )
    record(
        out,
        "trainer_expert_parallel",
        trainer,
        reference,
        local_experts=experts.gate_up_proj.shape[0],
        relative_difference=difference,
    )


@case
def trainer_zero3_pretrained(out: Path) -> None:
    """ZeRO-3 with the model loaded by from_pretrained under zero.Init: the loaded weights equal
    the saved ones exactly; losses equal the reference's; evaluate() after training; save_model
    (gathering 16-bit weights) then from_pretrained gives the trained weights back."""
    reference = plain(out)
    args = training_args(out / "z3", ZERO3)
    model = AutoModelForCausalLM.from_pretrained(pretrained(out))
    sliced = all(p.numel() == 0 for p in model.parameters())
    loaded = full_parameters(model)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset()[:8])
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trained = full_parameters(model)
    trainer.save_model(out / "z3_saved")
    extra: dict[str, Any] = {
        "sliced_by_zero_init": sliced,
        "eval_loss": eval_loss,
        "reference_eval_loss": reference.final_eval_loss,
    }
    if rank() == 0:
        saved = load_file(out / "pretrained" / "model.safetensors")
        extra["loaded_vs_saved"] = max_difference({k: loaded[k] for k in saved}, saved)
        save_file(trained, out / "z3_trained.safetensors")  # the test reloads save_model's output
    record(out, "trainer_zero3_pretrained", trainer, reference, **extra)


@case
def trainer_zero3_from_config(out: Path) -> None:
    """ZeRO-3 with the model built by from_config after TrainingArguments (zero.Init, then
    transformers initialises the weights on rank 0 inside GatheredParameters): the weights are
    finite and equal on every rank, and training matches the reference started from them."""
    args = training_args(out / "z3c", ZERO3)
    model = AutoModelForCausalLM.from_config(llama_config())
    sliced = all(p.numel() == 0 for p in model.parameters())
    start = full_parameters(model)
    finite = all(bool(torch.isfinite(v).all()) for v in start.values())
    spread = [torch.stack([v.sum() for v in start.values()]).double()]
    gathered = [torch.zeros_like(spread[0]) for _ in range(world())]
    torch.distributed.all_gather(gathered, spread[0])
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    reference = plain(out, start)
    record(
        out,
        "trainer_zero3_from_config",
        trainer,
        reference,
        sliced_by_zero_init=sliced,
        finite=finite,
        ranks_agree=all(torch.equal(g, gathered[0]) for g in gathered),
    )


@case
def trainer_gradient_accumulation(out: Path) -> None:
    """gradient_accumulation_steps 2 with micro-batches of 1 = accumulation 1 with micro-batches
    of 2: the same global batches, the same optimizer steps."""
    reference = plain(out)
    trainer = deepspeed_trainer(
        out / "gas2", ZERO2, per_device_train_batch_size=1, gradient_accumulation_steps=2
    )
    trainer.train()
    engine = trainer.model_wrapped
    record(
        out,
        "trainer_gradient_accumulation",
        trainer,
        reference,
        engine_gas=engine.gradient_accumulation_steps(),
        micro_steps=engine.micro_steps,
    )


@case
def trainer_resume(out: Path) -> None:
    """ZeRO-3: save at step 2, resume_from_checkpoint in a new Trainer, end where the run that
    never stopped ends; the checkpoint folder holds zero_to_fp32.py."""
    saving = {"save_strategy": "steps", "save_steps": 2}
    whole = deepspeed_trainer(out / "resume", ZERO3, **saving)
    whole.train()
    uninterrupted = full_parameters(whole.model)
    resumed = deepspeed_trainer(out / "resume2", ZERO3, **saving)
    resumed.train(resume_from_checkpoint=str(out / "resume" / "checkpoint-2"))
    record(
        out,
        "trainer_resume",
        resumed,
        whole,
        resumed_vs_uninterrupted=max_difference(full_parameters(resumed.model), uninterrupted),
        checkpoint_files=sorted(os.listdir(out / "resume" / "checkpoint-2")),
    )


@case
def trainer_zero3_save_without_gathering(out: Path) -> None:
    """stage3_gather_16bit_weights_on_model_save false: save_model writes a checkpoint and
    zero_to_fp32.py instead of model weights, as with DeepSpeed; the test consolidates it."""
    ds = with_stage(ZERO3, 3, stage3_gather_16bit_weights_on_model_save=False)
    trainer = deepspeed_trainer(out / "nogather", ds)
    trainer.train()
    trained = full_parameters(trainer.model)
    trainer.save_model(out / "nogather_saved")
    if rank() == 0:
        save_file(trained, out / "nogather_trained.safetensors")
    record(
        out,
        "trainer_zero3_save_without_gathering",
        trainer,
        plain(out),
        saved_files=sorted(os.listdir(out / "nogather_saved")),
    )


@case
def trainer_evaluate_first(out: Path) -> None:
    """evaluate() before any training at ZeRO-3: transformers builds an engine without optimizer
    and leaves the 'scheduler' section in the config."""
    reference = plain(out)
    trainer = deepspeed_trainer(out / "eval_first", ZERO3)
    eval_loss = trainer.evaluate()["eval_loss"]
    plain_args = training_args(out / "plain_eval", None)  # first: it resets the ZeRO-3 config
    reference_trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(pretrained(out)),
        args=plain_args,
        eval_dataset=dataset()[:8],
    )
    reference_eval = reference_trainer.evaluate()["eval_loss"]
    if rank() == 0:
        result = {"eval_loss": eval_loss, "reference_eval_loss": reference_eval}
        (out / f"trainer_evaluate_first-ws{world()}.json").write_text(json.dumps(result))
    del reference


@case
def trainer_bf16(out: Path) -> None:
    """bf16 ("auto" filled from TrainingArguments(bf16=True, use_cpu=True)) at ZeRO-2."""
    trainer = deepspeed_trainer(out / "bf16", ZERO2, bf16=True)
    trainer.train()
    engine = trainer.model_wrapped
    record(
        out,
        "trainer_bf16",
        trainer,
        plain(out),
        bf16=engine.bfloat16_enabled(),
        dtype=str(next(engine.module.parameters()).dtype),
    )


@case
def trainer_cpu_offload(out: Path) -> None:
    """The documented ZeRO-2 config with the optimizer offloaded to host memory."""
    ds = with_stage(ZERO2, 2, offload_optimizer={"device": "cpu", "pin_memory": True})
    trainer = deepspeed_trainer(out / "offload", ds)
    trainer.train()
    record(out, "trainer_cpu_offload", trainer, plain(out))


@case
def trainer_resume_deepspeed_run(out: Path) -> None:
    """A Trainer folder written under DeepSpeed 0.19.8 (`checkpoint-2/global_step2/*.pt`, the
    fixtures' `trainer_z<stage>`) resumes here with resume_from_checkpoint and ends where
    DeepSpeed's uninterrupted run ended."""
    import shutil

    sys.path.insert(0, str(FIXTURES))
    from make_fixtures import trainer_dataset, trainer_model_config

    results = {}
    for stage in (2, 3):
        folder = out / f"resume_ds_z{stage}"
        if rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(
                FIXTURES / f"trainer_z{stage}" / "checkpoint-2", folder / "checkpoint-2"
            )
        torch.distributed.barrier()
        ds = {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "zero_optimization": {"stage": stage},
        }
        args = training_args(
            folder, ds, max_steps=4, save_strategy="steps", save_steps=2, use_cpu=True
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(trainer_model_config(LlamaConfig))
        trainer = Trainer(model=model, args=args, train_dataset=trainer_dataset())
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
        final = full_parameters(model)
        if rank() == 0:
            expected = load_file(FIXTURES / f"trainer_z{stage}" / "final.safetensors")
            results[f"zero{stage}"] = {
                "final_vs_deepspeed": max_difference(final, expected),
                "losses": losses(trainer),
                "deepspeed_losses": json.loads(
                    (FIXTURES / f"trainer_z{stage}" / "losses.json").read_text()
                ),
                "global_steps": trainer.model_wrapped.global_steps,
            }
    if rank() == 0:
        (out / f"trainer_resume_deepspeed_run-ws{world()}.json").write_text(json.dumps(results))


# -- accelerate ----------------------------------------------------------------------------------


def accelerate_loop(
    plugin: DeepSpeedPlugin | None, micro: int, steps: int, state_dir: Path | None = None
) -> tuple[list[float], Any]:
    """A hand-written accelerate loop: `steps` optimizer steps, each over a global batch of 8
    samples (micro-batches of `micro` per rank, accumulated as the plugin says), clipped at 1.0.
    With `state_dir`: save_state after half the steps, load_state into a fresh Accelerator and
    model, and run the second half there; the losses are the first half's, then the resumed
    half's. Returns (micro-step losses, the prepared model)."""
    settings = dict(vars(plugin)) if plugin is not None else None

    def prepared() -> tuple[Accelerator, Any, Any, list]:
        reset(cpu=settings is None)
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(
                zero_stage=settings["zero_stage"],
                gradient_accumulation_steps=settings["gradient_accumulation_steps"],
                gradient_clipping=1.0,
            )
            if settings is not None
            else None
        )
        model = AutoModelForCausalLM.from_pretrained(pretrained(OUT))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        loader = torch.utils.data.DataLoader([d["input_ids"] for d in dataset()], batch_size=micro)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        return accelerator, model, optimizer, list(loader)

    def run(accelerator: Accelerator, model: Any, optimizer: Any, batches: list) -> list[float]:
        history = []
        for ids in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            history.append(loss.item())
        return history

    accelerator, model, optimizer, batches = prepared()
    per_step = accelerator.gradient_accumulation_steps
    if state_dir is None:
        return run(accelerator, model, optimizer, batches[: steps * per_step]), model
    half = steps // 2 * per_step
    first = run(accelerator, model, optimizer, batches[:half])
    accelerator.save_state(state_dir)
    accelerator, model, optimizer, batches = prepared()
    accelerator.load_state(state_dir)
    return first + run(accelerator, model, optimizer, batches[half : steps * per_step]), model


OUT = Path(".")


@case
def accelerate_plugin(out: Path) -> None:
    """Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2|3)): accumulation 2 over
    micro-batches of 2 = accumulation 1 over micro-batches of 4 = a DDP loop; save_state /
    load_state resume the second half exactly."""
    per_rank = 8 // world()
    ddp, ddp_model = accelerate_loop(None, per_rank, 4)
    ddp_params = {n: p.detach().clone() for n, p in ddp_model.module.named_parameters()}
    result: dict[str, Any] = {"ddp": ddp}
    for stage in (2, 3):
        one, model_one = accelerate_loop(
            DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1), per_rank, 4
        )
        one_params = full_parameters(model_one.module)
        split = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=2)
        two, model_two = accelerate_loop(split, per_rank // 2, 4)
        resumed, _ = accelerate_loop(split, per_rank // 2, 4, out / f"acc_state_z{stage}")
        result[f"zero{stage}"] = {
            "gas1": one,
            "gas2": two,
            "steps_gas1": model_one.global_steps,
            "steps_gas2": model_two.global_steps,
            "gas1_vs_ddp": max_difference(one_params, ddp_params),
            "gas2_vs_gas1": max_difference(full_parameters(model_two.module), one_params),
            "resumed": resumed,
        }
    if rank() == 0:
        (out / f"accelerate_plugin-ws{world()}.json").write_text(json.dumps(result))


@case
def accelerate_launched(out: Path) -> None:
    """Under `accelerate launch --use_deepspeed --zero_stage 2 --gradient_accumulation_steps 2`:
    the plugin comes from the launcher; the loop is accelerate's documented one."""
    PartialState(backend="gloo")
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(pretrained(out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loader = torch.utils.data.DataLoader([d["input_ids"] for d in dataset()], batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    history = []
    for i, ids in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        history.append(loss.item())
        if i + 1 == 8:
            break
    result = {
        "losses": history,
        "global_steps": model.global_steps,
        "engine": type(model).__module__,
        "gas": model.gradient_accumulation_steps(),
        "stage": model.zero_optimization_stage(),
        "world": world(),
    }
    if rank() == 0:
        (out / f"accelerate_launched-ws{world()}.json").write_text(json.dumps(result))


def sequence_dataset() -> list[dict[str, torch.Tensor]]:
    """The dataset with the position ids the sequence-parallel loader adapter needs."""
    positions = torch.arange(SEQ)
    return [{**sample, "position_ids": positions} for sample in dataset()]


def reference_training(
    batches: list[dict[str, torch.Tensor]], warmup: bool = False
) -> tuple[list, list, Any]:
    """One process, whole sequences, no DeepSpeed: AdamW (with `warmup_schedule` if `warmup`),
    clipping at 1.0, one step per batch. Returns the losses, the gradient norms before clipping,
    and the model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # A sequence-parallel run before replaced sdpa for the whole process: transformers' own again.
    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = getattr(current, "sequence_parallel_core", current)
    model = AutoModelForCausalLM.from_pretrained(pretrained(OUT), attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = warmup_schedule(optimizer) if warmup else None
    history, norms = [], []
    for batch in batches:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
        history.append(loss.item())
    return history, norms, model


# (name, sequence-parallel size, ZeRO stage, the config's sequence_parallel section) per world
# size. With two data-parallel groups the loss is shardspeed's sharded one: transformers' (a
# differentiable all-gather) fails on gloo in a group without global rank 0, a torch bug (its
# gloo backward scatters from group ranks taken as global ranks); NCCL is not affected.
SHARDED = {"loss": "sharded"}
SEQUENCE_RUNS: dict[int, list[tuple[str, int, int, dict]]] = {
    2: [("zero1", 2, 1, {}), ("zero3", 2, 3, {})],
    4: [
        ("sp2_dp2_zero1", 2, 1, SHARDED),
        ("sp2_dp2_zero3", 2, 3, SHARDED),
        ("hybrid_zero3", 4, 3, {"mode": "hybrid", "ulysses": {"degree": 2}}),
        # Ulysses over 4 with the model's 2 key/value heads: repeated up to 4, as DeepSpeed does
        ("ulysses4_zero1", 4, 1, {}),
        ("ring_zero1", 4, 1, {"mode": "ring"}),
    ],
}


def sequence_steps(sp: int, micro: int) -> list[dict[str, torch.Tensor]]:
    """The global batch of each step of a run with `sp` ranks per sequence: accelerate deals the
    loader's batches to the ranks in turn, and UlyssesSPDataLoaderAdapter has each sequence group
    train on its ranks' batches one after another; the data-parallel groups' batches together
    make the step's."""
    samples, dp = sequence_dataset(), world() // sp
    batches = [samples[i : i + micro] for i in range(0, 8 * dp * micro, micro)]
    return [
        torch.utils.data.default_collate(
            [x for g in range(dp) for x in batches[g * sp + t % sp + t // sp * world()]]
        )
        for t in range(8)
    ]


@case
def accelerate_sequence_parallel(out: Path) -> None:
    """Accelerator(parallelism_config=ParallelismConfig(sp_size=..., sp_backend="deepspeed")):
    accelerate registers DeepSpeed's Ulysses for the model's sdpa attention and wraps the loader
    in UlyssesSPDataLoaderAdapter; the loss is aggregated over the sequence ranks by transformers'
    own `deepspeed_sp_compute_loss` (what Trainer runs). Each run of SEQUENCE_RUNS against one
    process on whole sequences, step for step. Run in a launch of its own: registration replaces
    transformers' sdpa attention for the whole process."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from deepspeed.runtime.sequence_parallel.ulysses_sp import shard_cross_entropy
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    micro, result = 2, {}
    for name, sp, stage, section in SEQUENCE_RUNS[world()]:
        reset()  # transformers' ZeRO-3 config of the run before would shard the reference
        reference_losses, reference_norms, reference = reference_training(sequence_steps(sp, micro))
        config = ParallelismConfig(
            sp_size=sp,
            dp_replicate_size=world() // sp,
            sp_backend="deepspeed",
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
            ),
        )
        ds_config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            **({"sequence_parallel": section} if section else {}),
        }
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), parallelism_config=config
        )
        model = AutoModelForCausalLM.from_pretrained(pretrained(out), attn_implementation="sdpa")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        samples = sequence_dataset()[: 8 * (world() // sp) * micro]
        loader = torch.utils.data.DataLoader(samples, batch_size=micro)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        model.train()  # accelerate registers Ulysses with disable_in_eval: eval runs local slices
        history, norms = [], []
        for batch in loader:
            if section is SHARDED:
                logits = model(
                    input_ids=batch["input_ids"], position_ids=batch["position_ids"]
                ).logits
                group = groups._get_sequence_parallel_group()
                loss = shard_cross_entropy(logits, batch["shift_labels"], group)
            else:
                loss = deepspeed_sp_compute_loss(accelerator, model, batch, False, config)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            history.append(loss.item())
            norms.append(float(model.get_global_grad_norm()))
        # A step's loss is its group's (a sharded one: this rank's part); the reference's is the
        # mean over the groups' batches.
        history = torch.tensor(history)
        torch.distributed.all_reduce(history)
        result[name] = {
            "losses": (history / (world() if section is not SHARDED else world() // sp)).tolist(),
            "norms": norms,
            "reference_losses": reference_losses,
            "reference_norms": reference_norms,
            "global_steps": model.global_steps,
            "sequence_parallel_size": model.sequence_parallel_size,
            "engine": type(model).__module__,
            "relative_difference": max(
                ((p - dict(reference.named_parameters())[n]).norm() / p.norm()).item()
                for n, p in full_parameters(model.module).items()
            ),
        }
    if rank() == 0:
        (out / f"accelerate_sequence_parallel-ws{world()}.json").write_text(json.dumps(result))


@case
def trainer_sequence_parallel(out: Path) -> None:
    """TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"),
    deepspeed=ZeRO-3 config): Trainer's own sequence-parallel path (the loader adapter, its loss
    aggregation) trains like one process stepping through the batches the Trainer drew, in the
    order the sequence group trains them (rank 0's first, rank 1's first, rank 0's second, ...)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    config = ParallelismConfig(
        sp_size=2,
        sp_backend="deepspeed",
        sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
    )
    seen: list[int] = []

    class Recording(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.samples = sequence_dataset()

        def __len__(self) -> int:
            return len(self.samples)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            seen.append(index)
            return self.samples[index]

    args = training_args(
        out, with_stage(ZERO3, 3), parallelism_config=config, per_device_train_batch_size=2
    )
    model = AutoModelForCausalLM.from_pretrained(pretrained(out), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Recording(),
        optimizers=(optimizer, warmup_schedule(optimizer)),
    )
    trainer.train()
    engine = trainer.model_wrapped
    trained = full_parameters(engine.module)
    drawn = [None] * world()
    torch.distributed.all_gather_object(drawn, seen)
    steps = STEPS // world()  # each rank's batches feed this many steps; the loader reads ahead
    order = [drawn[r][2 * b : 2 * b + 2] for b in range(steps) for r in range(world())]
    samples = sequence_dataset()
    reset()  # the reference outside transformers' ZeRO-3 loading
    reference_losses, _, reference = reference_training(
        [torch.utils.data.default_collate([samples[i] for i in batch]) for batch in order], True
    )
    result = {
        "losses": losses(trainer),
        "reference_losses": reference_losses,
        "relative_difference": max(
            ((p - dict(reference.named_parameters())[n]).norm() / p.norm()).item()
            for n, p in trained.items()
        ),
        "global_steps": engine.global_steps,
        "sequence_parallel_size": engine.sequence_parallel_size,
        "engine": type(engine).__module__,
        "seen": seen,
    }
    if rank() == 0:
        (out / f"trainer_sequence_parallel-ws{world()}.json").write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    global OUT
    OUT = Path(argv[0])
    OUT.mkdir(parents=True, exist_ok=True)
    if not torch.distributed.is_initialized():
        PartialState(backend="gloo")
    for name in argv[1:]:
        if name not in CASES:  # TRL's and PEFT's, which share this launch
            sys.modules.setdefault("hf_jobs", sys.modules[__name__])  # this module, not a copy
            import post_training_jobs

            reset()
            post_training_jobs.CASES[name](OUT)
            continue
        CASES[name](OUT)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
