#!/usr/bin/env bash
# Prepares everything `make train` and `make test` need: system MPI, SLURM and Chromium (when
# apt is there and they are missing), the virtual environment, torch, deepspeed, mpi4py and
# trainrun itself. A second run with nothing changed returns at once.
#
# Environment:  VENV (default .venv)   PYTHON (default python3)
#               TORCH_SPEC (default torch==2.13.0, used only when no torch is importable)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp="$VENV/.trainrun-setup"
fingerprint=$(cat pyproject.toml tools/bootstrap.sh | sha1sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi

say() { printf '[setup] %s\n' "$*"; }

install_system_packages() {
    local missing=()
    command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin libopenmpi-dev)
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm munge)
    # headless Chromium: the docs tests open the built site as a reader would
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    [ ${#missing[@]} -eq 0 ] && return 0
    if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
        say "skipping ${missing[*]}: needs apt-get as root (their tests will be skipped)"
        return 0
    fi
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

make_venv() {
    [ -x "$VENV/bin/python" ] && return 0
    if "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
        say "creating $VENV on top of the torch that $PYTHON already has"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        say "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
}

install_torch() {
    if "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        say "keeping torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
        return 0
    fi
    say "pip install $TORCH_SPEC"
    "$VENV/bin/pip" install -q "$TORCH_SPEC"
}

install_system_packages
make_venv
install_torch
# the trackers' packages (wandb, mlflow-skinny) take about 30 s more; their tests run offline;
# hf (transformers) is the Hugging Face example's, whose tests build GPT-2 without a download;
# bench (MMEngine 0.10.7) is the oracle of trainrun.compat.mmengine's tests and the benches'
say "pip install -e .[dev,mpi,tensorboard,wandb,mlflow,hf,docs,bench] (deepspeed, mpi4py, pytest, trackers, transformers, sphinx, mmengine, ...)"
"$VENV/bin/pip" install -q -e ".[dev,mpi,tensorboard,wandb,mlflow,hf,docs,bench]"
echo "$fingerprint" > "$stamp"
say "ready: $("$VENV/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null | tail -1)"
