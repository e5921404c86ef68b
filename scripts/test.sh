#!/usr/bin/env bash
# The whole check: style (ruff lint + format) and the full test suite, on CPU with gloo.
source "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# The core suite (the laptop budget: under 15 minutes), then two stages apart from it, each with
# what it installs first: the cluster launchers through the real tools (Debian's slurm-wlm,
# openmpi-bin, mpich, pdsh and openssh-server, installed by the tests' fixture when missing: about
# 3 minutes, then 2-3 minutes of jobs), and LlamaFactory's own command line in its own environment
# (built once under .cache/ by scripts/llamafactory_env.sh: about 8 GB, 4 minutes).
.venv/bin/python -m pytest --ignore=tests/test_llamafactory.py --ignore=tests/test_cluster_launchers.py
.venv/bin/python -m pytest tests/test_cluster_launchers.py
./scripts/llamafactory_env.sh >/dev/null
exec .venv/bin/python -m pytest tests/test_llamafactory.py
