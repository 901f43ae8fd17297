#!/usr/bin/env bash
# Train CONFIG data-parallel on NUM_PROCS processes of this machine:
#   tools/dist_train.sh CONFIG NUM_PROCS [train arguments ...]
# is `trainrun train CONFIG --nproc NUM_PROCS [train arguments ...]`: the config is checked
# first (a bad key exits 2 before any process starts), then torchrun starts the workers, and a
# failure ends with the failing worker's one line and exit code.
# Several machines (NNODES > 1): run this on each, with NODE_RANK, MASTER_ADDR (the first
# machine's address) and PORT set alike; it then calls torchrun itself, with --launcher pytorch.
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), PORT (default: a free one;
#              only for several machines), PYTHON (the venv's python when there is one).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG NUM_PROCS [train arguments ...]" >&2
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
if [ "${NNODES:-1}" = 1 ]; then
    exec "$PYTHON" -m trainrun train "$CONFIG" --nproc "$NPROC" "$@"
fi
PORT=${PORT:-$("$PYTHON" -c 'from trainrun.dist.launch import free_port; print(free_port())')}
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$PORT" \
    --nproc_per_node "$NPROC" \
    "$ROOT/tools/train.py" "$CONFIG" --launcher pytorch "$@"
