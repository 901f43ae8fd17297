"""Run under `mpirun -np N ... mpi4py_check.py OUT_DIR`: the mpi4py object backend gathers and
broadcasts objects; each rank writes what it saw to OUT_DIR/rank<N>.json (mpirun merges the
ranks' stdout without regard to lines)."""

import json
import sys
from pathlib import Path

from trainrun.dist import get_dist_backend

backend = get_dist_backend("mpi4py")
gathered = backend.all_gather_object({"rank": backend.rank})
from_last = backend.broadcast_object(f"from {backend.rank}", src=backend.world_size - 1)
seen = {"rank": backend.rank, "world_size": backend.world_size,
        "initialized": backend.is_initialized, "gathered": gathered, "broadcast": from_last}
(Path(sys.argv[1]) / f"rank{backend.rank}.json").write_text(json.dumps(seen))
