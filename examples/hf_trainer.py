"""Hugging Face Trainer with a DeepSpeed config, running on shardspeed: nothing here names shardspeed.

    SHARDSPEED_AS_DEEPSPEED=1 torchrun --nproc_per_node 2 examples/hf_trainer.py \\
        --deepspeed examples/hf_zero3.json

This is the script a Hugging Face user already has: a model built from a config, a dataset, a
`TrainingArguments(deepspeed=...)` holding Hugging Face's documented ZeRO config (`hf_zero2.json`,
`hf_zero3.json`: "auto" everywhere), `Trainer.train()`, `save_model()`, then sampling from the saved
model. The switch `SHARDSPEED_AS_DEEPSPEED=1` makes every process's `deepspeed` shardspeed, so
transformers and accelerate drive shardspeed's engine. The data is the demo's corpus (Python's
standard-library docstrings, as bytes); the model a small Llama over the 256 byte values.

On a machine without a GPU the first line of `main` is needed with DeepSpeed itself as well:
accelerate starts a distributed CPU job only when told its backend.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import ByteDataset, build_corpus


class CausalBytes(torch.utils.data.Dataset):
    """The demo's byte windows in the shape Trainer feeds a causal LM (labels = inputs)."""

    def __init__(self, windows: ByteDataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, _ = self.windows[i]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    PartialState(backend="gloo" if not torch.cuda.is_available() else None)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default=str(Path(__file__).with_name("hf_zero3.json")))
    parser.add_argument("--out", default="runs/hf_trainer")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="per process")
    args = parser.parse_args()

    training = TrainingArguments(
        output_dir=args.out,
        deepspeed=args.deepspeed,
        per_device_train_batch_size=args.batch,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        warmup_steps=args.max_steps // 10,
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    # Built after TrainingArguments: with a ZeRO-3 config every process keeps only its slice.
    model = AutoModelForCausalLM.from_config(config)
    data = CausalBytes(ByteDataset(build_corpus(Path(args.out) / "corpus"), block_size=128))
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.train()
    trainer.save_model(f"{args.out}/model")

    if training.process_index == 0:
        # The plain constructor, not from_pretrained: under a ZeRO-3 config from_pretrained builds
        # inside zero.Init, which every process must enter (as with DeepSpeed).
        saved = LlamaForCausalLM(config)
        saved.load_state_dict(load_file(f"{args.out}/model/model.safetensors"), strict=False)
        saved.tie_weights()
        prompt = torch.tensor([list(b"def ")])
        # synced_gpus=False: transformers would otherwise wait for the other ranks (ZeRO-3).
        sample = saved.generate(prompt, max_new_tokens=64, do_sample=False, synced_gpus=False)
        print("sample:", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
