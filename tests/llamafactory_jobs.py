"""LlamaFactory's own command line (`llamafactory-cli train`) on shardspeed, as its users run it.

Everything it trains on is made here, offline: a tiny Qwen2 model saved from a config, a byte-level
tokenizer with Qwen's chat tokens (so LlamaFactory's `qwen` template applies as to a real Qwen), and
an alpaca-format data set registered in a `dataset_info.json`. The DeepSpeed configs are the ones
LlamaFactory ships (`examples/deepspeed/`, unpacked from its source release by
`scripts/llamafactory_env.sh`), used unmodified.

Run with the LlamaFactory environment's Python (`.cache/llamafactory-*/bin/python`), which has
LlamaFactory's own pins of transformers, accelerate, PEFT and TRL:
    python tests/llamafactory_jobs.py inputs DIR
    python tests/llamafactory_jobs.py train DIR CONFIG full|lora   (CONFIG: ddp or a SHIPPED name)
    python tests/llamafactory_jobs.py compare DIR CONFIG CONFIG full|lora   (prints JSON)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# DeepSpeed configs LlamaFactory ships, by the short names the tests and the benchmark use.
SHIPPED = {
    "z0": "ds_z0_config.json",
    "z2": "ds_z2_config.json",
    "z3": "ds_z3_config.json",
    "z2_offload": "ds_z2_offload_config.json",
    "z3_offload": "ds_z3_offload_config.json",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
STEPS = 4
# Every run is fp32 and sums the same per-rank gradients; ZeRO's reduce-scatter and DDP's buckets
# add them in another order, which moves gradients in the last bits (grad norms agree to ~1e-7
# relative) and, through 4 Adam steps, the loss by ~1e-6 at most. A real mistake (a missed average,
# another data shard, a skipped or doubled step) moves it by more than 1e-3.
LOSS_RTOL = 1e-5


def make_inputs(root: Path) -> None:
    """The model, tokenizer and data set every run trains on (same files, so same start)."""
    import torch
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # Byte-level with no merges: any text encodes, one token per byte, nothing to train.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL,
    )
    tokenizer.save_pretrained(root / "model")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(root / "model")

    rows = [
        {"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} plus {b} is {a + b}."}
        for a, b in ((i, 3 * i % 7) for i in range(32))
    ]
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "sums.json").write_text(json.dumps(rows))
    info = {"sums": {"file_name": "sums.json"}}
    (root / "data" / "dataset_info.json").write_text(json.dumps(info))


def write_config(root: Path, config: str, method: str, out: Path) -> Path:
    """The YAML a user gives `llamafactory-cli train`: fp32 (no GPU), a fixed number of steps."""
    lines = {
        "model_name_or_path": str(root / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": method,
        "dataset": "sums",
        "dataset_dir": str(root / "data"),
        "template": "qwen",
        "cutoff_len": 128,
        "overwrite_cache": True,
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "plot_loss": False,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": STEPS,
        "learning_rate": 1e-3 if method == "full" else 5e-3,
        "lr_scheduler_type": "constant",
        "seed": 42,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    if method == "lora":
        lines |= {"lora_rank": 4, "lora_target": "all"}
    if config != "ddp":
        lines["deepspeed"] = str(shipped_dir() / SHIPPED[config])
    path = out.with_suffix(".yaml")
    # JSON is YAML, and keeps strings such as "no" from being read as booleans.
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in lines.items()))
    return path


def shipped_dir() -> Path:
    """LlamaFactory's examples/deepspeed, unpacked beside the environment by its build script."""
    return Path(sys.prefix) / "llamafactory-examples" / "deepspeed"


def train(root: Path, config: str, method: str) -> subprocess.CompletedProcess:
    """`llamafactory-cli train` on 2 processes (LlamaFactory starts them with torchrun)."""
    out = root / f"{config}-{method}"
    yaml = write_config(root, config, method, out)
    env = {
        **os.environ,
        # As in an activated environment: LlamaFactory starts `torchrun` by name.
        "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "FORCE_TORCHRUN": "1",
        "NPROC_PER_NODE": "2",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        # The plain run is the reference: DDP with nothing of shardspeed's in it.
        "SHARDSPEED_AS_DEEPSPEED": "" if config == "ddp" else "1",
    }
    cli = Path(sys.prefix) / "bin" / "llamafactory-cli"
    return subprocess.run(
        [str(cli), "train", str(yaml)], env=env, capture_output=True, text=True, timeout=900
    )


def losses(root: Path, config: str, method: str) -> list[float]:
    """The loss Trainer logged at each step (trainer_state.json's log history)."""
    state = json.loads((root / f"{config}-{method}" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def load_saved(root: Path, config: str, method: str):
    """What a run saved, loaded back as its users load it (a model, or the base plus the adapter)."""
    from transformers import AutoModelForCausalLM

    if method == "full":
        return AutoModelForCausalLM.from_pretrained(root / f"{config}-{method}")
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(root / "model")
    return PeftModel.from_pretrained(base, root / f"{config}-{method}")


def compare(root: Path, first: str, second: str, method: str) -> dict[str, float]:
    """How far apart two runs' saved results are, and how far training moved the first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    batch = tokenizer(["<|im_start|>user\nAdd 2 and 5.<|im_end|>\n"], return_tensors="pt")
    one, two = load_saved(root, first, method), load_saved(root, second, method)
    base = AutoModelForCausalLM.from_pretrained(root / "model")
    with torch.no_grad():
        logits = [model(**batch).logits for model in (one, two, base)]
    pairs = zip(one.state_dict().values(), two.state_dict().values(), strict=True)
    return {
        "weights": max((a - b).abs().max().item() for a, b in pairs),
        "logits": (logits[0] - logits[1]).abs().max().item(),
        "trained": (logits[0] - logits[2]).abs().max().item(),
    }


if __name__ == "__main__":
    command, root = sys.argv[1], Path(sys.argv[2])
    if command == "inputs":
        make_inputs(root)
    elif command == "compare":
        print(json.dumps(compare(root, *sys.argv[3:6])))
    else:
        done = train(root, sys.argv[3], sys.argv[4])
        sys.stdout.write(done.stdout[-4000:] + done.stderr[-8000:])
        sys.exit(done.returncode)
