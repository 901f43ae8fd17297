#!/usr/bin/env bash
# `make bench-collectives`: trainrun's object collectives against MMEngine 0.10.7's on 2 gloo
# ranks (MMEngine installed bench-only, see common.sh). Arguments go to bench/collectives.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh

install_mmengine --required
exec "$VENV/bin/torchrun" --nproc_per_node 2 --master_port "$(free_port)" \
    bench/collectives.py "$@"
