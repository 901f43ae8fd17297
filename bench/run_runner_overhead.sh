#!/usr/bin/env bash
# `make bench-runner`: the runner's cost per training step against a hand-written PyTorch DDP
# loop (and MMEngine 0.10.7's Runner, installed bench-only, see common.sh) on 2 gloo ranks.
# Arguments go to bench/runner_overhead.py (e.g. --rounds 25, --no-mmengine).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh

case " $* " in *" --no-mmengine "*) ;; *) install_mmengine ;; esac
exec "$VENV/bin/torchrun" --nproc_per_node 2 --master_port "$(free_port)" \
    bench/runner_overhead.py "$@"
