#!/usr/bin/env bash
# The expert_parallel tests under other transformers releases than the test extra's: 5.6.0 (the
# newest LlamaFactory allows) and 5.15.1 (the one DeepSpeed's AutoEP runs with). Each in a venv of
# its own under .cache/ (made once), shardspeed from src/.
#   ./scripts/check_transformers_range.sh [VERSION ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for version in "${@:-5.6.0 5.15.1}"; do
  for v in $version; do
    venv=".cache/transformers-$v"
    if [ ! -x "$venv/bin/python" ]; then
      python3 -m venv "$venv"
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" \
        "transformers==$v" safetensors "pydantic>=2.5,<3" pytest numpy tqdm
    fi
    echo "== transformers $v"
    PYTHONPATH=src "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_auto_ep.py
  done
done
