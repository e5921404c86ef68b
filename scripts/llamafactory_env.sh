#!/usr/bin/env bash
# LlamaFactory's own environment, for tests/test_llamafactory.py and benchmarks/llamafactory_cli.py:
# a venv of its own under .cache/ (made once, about 8 GB and 4 minutes with the registry reachable)
# with the versions LlamaFactory 0.9.5 pins (transformers <= 5.6.0, accelerate <= 1.11.0,
# peft <= 0.18.1, trl <= 0.24.0, datasets <= 4.0.0, each at its newest allowed), shardspeed from this
# checkout, and the DeepSpeed configs LlamaFactory ships (examples/deepspeed/, from its source
# release; the wheel leaves them out).
# LlamaFactory imports torchaudio, which has no release for our torch 2.13, so torch, torchvision
# and torchaudio are 2.9.1 / 0.24.1 / 2.9.1, one release (the registry's builds of them carry CUDA
# libraries, which stay unused on the CPU).
#   ./scripts/llamafactory_env.sh           build it if missing; print its path
#   ./scripts/llamafactory_env.sh --where   print its path only
# Exit status 75: the package registry could not be reached, so nothing was built.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=0.9.5
venv="$PWD/.cache/llamafactory-$version"
pins="llamafactory==$version torch==2.9.1 torchvision==0.24.1 torchaudio==2.9.1 transformers==5.6.0"
pins="$pins accelerate==1.11.0 peft==0.18.1 trl==0.24.0 datasets==4.0.0"
if [ "${1:-}" = "--where" ] || [ "$(cat "$venv/.built" 2>/dev/null)" = "$pins" ]; then
  echo "$venv"
  exit 0
fi

started=$SECONDS
sdist="$(mktemp -d)"
trap 'rm -rf "$sdist"' EXIT
# pip, quiet unless it fails (then its output, less the notes about this machine's local indexes).
pip_quiet() {
  "$@" -q --disable-pip-version-check >"$sdist/log" 2>&1 || {
    local status=$?
    grep -v "is ignored" "$sdist/log" >&2 || true
    return $status
  }
}
# The source release first: a registry that cannot be reached says so here, before the venv is made.
if ! pip_quiet python3 -m pip download --no-deps --no-binary :all: -d "$sdist" "llamafactory==$version"; then
  echo "llamafactory_env.sh: could not download llamafactory $version from the package registry;" \
    "run this script again where the registry is reachable" >&2
  exit 75
fi
rm -rf "$venv"
python3 -m venv "$venv"
# shellcheck disable=SC2086  # the pins are separate words
pip_quiet "$venv/bin/python" -m pip install $pins
pip_quiet "$venv/bin/python" -m pip install -e .
tar -xzf "$sdist"/llamafactory-*.tar.gz -C "$sdist"
mkdir -p "$venv/llamafactory-examples"
cp -r "$sdist"/llamafactory-$version/examples/deepspeed "$venv/llamafactory-examples/"
echo "$pins" >"$venv/.built"
echo "llamafactory_env.sh: built in $((SECONDS - started)) s" >&2
echo "$venv"
