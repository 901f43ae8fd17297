# Sourced by the bench/run_*.sh scripts: the venv, a bench-only MMEngine, a free port.
# Environment:  VENV (default .venv)

VENV=${VENV:-.venv}
PY="$VENV/bin/python"

torch_version() { "$PY" -c 'import torch; print(torch.__version__)'; }

# install_mmengine [--required]: pip install mmengine==0.10.7 into the venv unless it imports.
# torch must stay as it was. Without --required a failed install is not fatal (the bench then
# says why it skips MMEngine).
install_mmengine() {
    "$PY" -c 'import mmengine.dist, mmengine.runner' >/dev/null 2>&1 && return 0
    local before
    before=$(torch_version)
    echo "[bench] pip install mmengine==0.10.7 (bench only)"
    if ! "$VENV/bin/pip" install -q mmengine==0.10.7; then
        [ "${1-}" = "--required" ] && exit 1
        return 0
    fi
    if [ "$(torch_version)" != "$before" ]; then
        echo "[bench] installing mmengine changed torch from $before to $(torch_version)" >&2
        exit 1
    fi
}

free_port() {  # trainrun's own (run from the repository's root, so trainrun imports)
    "$PY" -c 'from trainrun.dist.launch import free_port; print(free_port())'
}

# One thread per rank: two ranks share the two cores of a laptop-sized machine.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
