#!/usr/bin/env bash
# Train CONFIG data-parallel on NUM_PROCS processes of this machine with torchrun.
#   tools/dist_train.sh CONFIG NUM_PROCS [train.py arguments ...]
# Environment: PORT (default: a free one), NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1),
#              PYTHON (the venv's python when there is one).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG NUM_PROCS [train.py arguments ...]" >&2
    exit 2
fi
CONFIG=$1
NPROC=$2
shift 2
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: NUM_PROCS must be a positive whole number, got '$NPROC'" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3 )}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PORT=${PORT:-$("$PYTHON" -c 'from trainrun.dist.launch import free_port; print(free_port())')}
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$PORT" \
    --nproc_per_node "$NPROC" \
    "$ROOT/tools/train.py" "$CONFIG" --launcher pytorch "$@"
