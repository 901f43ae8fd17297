"""Run under `mpirun -np N`: the mpi4py object backend gathers and broadcasts objects."""

import json

from trainrun.dist import get_dist_backend

backend = get_dist_backend("mpi4py")
gathered = backend.all_gather_object({"rank": backend.rank})
from_last = backend.broadcast_object(f"from {backend.rank}", src=backend.world_size - 1)
print(json.dumps({"rank": backend.rank, "world_size": backend.world_size,
                  "initialized": backend.is_initialized, "gathered": gathered,
                  "broadcast": from_last}), flush=True)
