#!/usr/bin/env bash
# Train with srun on a SLURM partition (interactive; for a batch job see slurm_train.sbatch).
#   tools/slurm_train.sh PARTITION JOB_NAME CONFIG [train.py args...]
# Environment: TASKS (processes in all, default 8), TASKS_PER_NODE (default min(TASKS, 8)),
# GPUS_PER_TASK (default 1; 0 on a CPU partition), CPUS_PER_TASK (default 4),
# SRUN_ARGS (more srun options), PYTHON (default python).
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG [train.py args...]" >&2
    exit 2
fi
PARTITION=$1 JOB_NAME=$2 CONFIG=$3
shift 3
TASKS=${TASKS:-8}
TASKS_PER_NODE=${TASKS_PER_NODE:-$(( TASKS < 8 ? TASKS : 8 ))}
GPUS_PER_TASK=${GPUS_PER_TASK:-1}
CPUS_PER_TASK=${CPUS_PER_TASK:-4}
gpus=()
[ "$GPUS_PER_TASK" -gt 0 ] && gpus=(--gpus-per-task="$GPUS_PER_TASK")
cd "$(dirname "$0")/.."
# shellcheck disable=SC2086  # SRUN_ARGS is a list of options
exec srun --partition="$PARTITION" --job-name="$JOB_NAME" --ntasks="$TASKS" \
    --ntasks-per-node="$TASKS_PER_NODE" --cpus-per-task="$CPUS_PER_TASK" "${gpus[@]}" \
    --kill-on-bad-exit=1 ${SRUN_ARGS:-} "${PYTHON:-python}" -u tools/train.py "$CONFIG" \
    --launcher slurm "$@"
