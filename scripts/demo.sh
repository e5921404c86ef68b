#!/usr/bin/env bash
# The main job: train a small GPT on 2 processes, then sample from the trained checkpoint.
# Arguments go to the script: `./scripts/demo.sh --resume` continues from runs/demo/checkpoints.
source "$(dirname "$0")/_venv.sh"
exec .venv/bin/shardspeed --num_procs 2 examples/train_gpt.py \
  --deepspeed_config examples/ds_config.json "$@"
