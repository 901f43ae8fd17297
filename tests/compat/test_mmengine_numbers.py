"""MMEngine's numbers: a seeded MMEngine script (scripts/seeded_mmengine.py: DefaultSampler with
shuffle, a seed, SGD with momentum, MultiStepLR by epoch, a registered model and metric, a hook
that records every iteration's loss on every rank) gives the same losses under
``trainrun.compat.mmengine``, with only its import lines changed, as under MMEngine 0.10.7
itself, in one process and under DDP on 2 CPU processes. MMEngine is the oracle: it runs here,
with the three CPU patches of scripts/mmengine_on_cpu.py and nothing else patched."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.cli import run
from trainrun.dist.launch import free_port

pytest.importorskip("mmengine", reason="MMEngine (the oracle) is installed by make setup's "
                                       "bench extra")

SCRIPTS = Path(__file__).parent / "scripts"
MMENGINE_IMPORT = re.compile(r"^from mmengine\.", re.MULTILINE)
# MMEngine 0.10.7's rank 1 sometimes aborts at interpreter exit, after its last validation
# (gloo's threads); the losses are all written by then
EXIT_ABORT = "terminate called without an active exception"


def compat_script(directory: Path) -> Path:
    """The seeded script with ``mmengine`` replaced by ``trainrun.compat.mmengine`` in its
    import lines: the one change a user makes."""
    text = (SCRIPTS / "seeded_mmengine.py").read_text(encoding="utf-8")
    changed = MMENGINE_IMPORT.sub("from trainrun.compat.mmengine.", text)
    assert [a for a, b in zip(text.splitlines(), changed.splitlines(), strict=True) if a != b] \
        == [line for line in text.splitlines() if line.startswith("from mmengine.")]
    path = directory / "seeded_compat.py"
    path.write_text(changed, encoding="utf-8")
    return path


def train(script: Path, work_dir: Path, procs: int, *args: str) -> dict[tuple[int, int], dict]:
    """Run ``script`` on ``procs`` processes; its recorded iterations by (rank, iter)."""
    options = ["--work-dir", str(work_dir), "--seed", "42", *args]
    if procs == 1:
        done = run([sys.executable, str(script), "--launcher", "none", *options])
    else:
        done = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                    str(procs), "--master_port", str(free_port()), str(script),
                    "--launcher", "pytorch", *options])
    assert done.returncode == 0 or EXIT_ABORT in done.stderr, done.stderr[-3000:]
    records = {}
    for path in sorted(work_dir.glob("losses_rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["rank"], record["iter"]] = record
    return records


RUNS = {  # processes, options, iterations recorded (over all ranks)
    "1 process, tuple samples": (1, ("--data-format", "tuple"), 96),
    "2 processes, dict samples": (2, ("--data-format", "dict"), 96),
    "2 processes, InfiniteSampler": (2, ("--iter-based",), 80),
    # each rank seeds with seed + rank (dropout differs by rank); the samplers share
    # MMEngine's synced draw
    "2 processes, diff_rank_seed": (2, ("--diff-rank-seed",), 96),
    # the model's init_weights (and a child's) redraw weights before training; with
    # diff_rank_seed each rank draws its own, and rank 0's are broadcast
    "2 processes, init_weights": (2, ("--init-weights", "--diff-rank-seed"), 96),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_the_compat_runner_gives_mmengines_losses_on_every_rank(tmp_path: Path, name: str):
    procs, options, count = RUNS[name]
    theirs = train(SCRIPTS / "mmengine_on_cpu.py", tmp_path / "mmengine", procs, *options)
    ours = train(compat_script(tmp_path), tmp_path / "compat", procs, *options)
    assert len(theirs) == count and sorted(ours) == sorted(theirs)
    for key, record in theirs.items():
        assert abs(ours[key]["loss"] - record["loss"]) <= 1e-6, key
        assert ours[key]["labels"] == record["labels"], key  # the same samples, in order
        assert ours[key]["lr"] == record["lr"], key
    assert [ours[key]["epoch"] for key in sorted(ours)] == \
        [theirs[key]["epoch"] for key in sorted(theirs)]
