#!/usr/bin/env bash
# `make bench-compile`: compile: true against false on the digits and tiny-LM configs, 2 gloo
# ranks, with an empty inductor cache (the first compiled step pays the whole compile).
# Arguments go to bench/compile.py (e.g. --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh

TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR
runs=$(mktemp -d)
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$runs"' EXIT
"$VENV/bin/torchrun" --nproc_per_node 2 --master_port "$(free_port)" bench/compile.py \
    --work-dir "$runs" "$@"
