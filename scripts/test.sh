#!/usr/bin/env bash
# The whole check: style (ruff lint + format) and the full test suite, on CPU with gloo.
source "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
