#!/usr/bin/env bash
# `make bench`: trainrun's object collectives against MMEngine 0.10.7's on 2 gloo ranks.
# MMEngine is a bench-only dependency, installed into the venv only when it is not importable;
# the install must leave torch as it was. Arguments go to bench/collectives.py.
#
# Environment:  VENV (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"

torch_version() { "$PY" -c 'import torch; print(torch.__version__)'; }

install_mmengine() {
    "$PY" -c 'import mmengine.dist' >/dev/null 2>&1 && return 0
    local before
    before=$(torch_version)
    echo "[bench] pip install mmengine==0.10.7 (bench only)"
    "$VENV/bin/pip" install -q mmengine==0.10.7
    if [ "$(torch_version)" != "$before" ]; then
        echo "[bench] installing mmengine changed torch from $before to $(torch_version)" >&2
        exit 1
    fi
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

install_mmengine
# One thread per rank: two ranks share the two cores of a laptop-sized machine.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/torchrun" --nproc_per_node 2 --master_port "$(free_port)" \
    bench/collectives.py "$@"
