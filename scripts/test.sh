#!/usr/bin/env bash
# The whole check: style (ruff lint + format) and the full test suite, on CPU with gloo.
source "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# The whole suite, then LlamaFactory's own command line in LlamaFactory's own environment (built once
# under .cache/ by scripts/llamafactory_env.sh: about 8 GB, 4 minutes), apart from the core suite.
.venv/bin/python -m pytest --ignore=tests/test_llamafactory.py
./scripts/llamafactory_env.sh >/dev/null
exec .venv/bin/python -m pytest tests/test_llamafactory.py
