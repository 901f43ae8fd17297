"""One seed for every rank, determinism switches, and RNG state for exact resume.

RNG states are stored as tensors and plain numbers only, so a checkpoint holding them loads
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from trainrun.dist import get_rank, sync_random_seed
from trainrun.runner.schema import check_bool, integer, nullable, section

SEED_LIMIT = 2**31
RANDOMNESS_KEYS = {
    "seed": (42, nullable(integer(0, SEED_LIMIT)),
             "rank 0's seed, sent to every rank (null: a fresh random one each run)"),
    "deterministic": (False, check_bool,
                      "deterministic algorithms only (torch.use_deterministic_algorithms, "
                      "cuDNN's deterministic mode): slower, the same results run after run "
                      "on a GPU"),
    "diff_rank_seed": (False, check_bool,
                       "each rank seeds with seed + its rank (the data order stays shared)"),
}
check_randomness = section(RANDOMNESS_KEYS)


def set_random_seed(seed: int | None, deterministic: bool = False,
                    diff_rank_seed: bool = False) -> int:
    """Seed python, numpy and torch with rank 0's seed (plus the rank with ``diff_rank_seed``).

    Returns rank 0's seed, the same on every rank: what samplers must use, so that ranks
    share one data order even when their random streams differ.
    """
    seed = sync_random_seed(seed)
    own = seed + get_rank() if diff_rank_seed else seed
    random.seed(own)
    np.random.seed(own % 2**32)
    torch.manual_seed(own)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    return seed


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: numpy and python get the seed torch gave this worker."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch (and CUDA) generator states."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
