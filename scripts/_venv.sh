# Sourced by demo.sh and test.sh: make .venv (once) and install shardspeed into it.
# torch is pinned to 2.13.0 here: on these machines that is a local CPU build, while an unpinned
# torch would pull a multi-GB CUDA build. The library itself accepts any torch >= 2.4.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]"
