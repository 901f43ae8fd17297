"""A stand-in for tools/train.py in the sweep's loop test: starts in milliseconds, records its
arguments in WORK_DIR/calls.txt, fails the first time for lr=3e-3 hidden=64, and otherwise
logs a loss and an accuracy as a finished run would."""

import json
import sys
from pathlib import Path

argv = sys.argv[1:]
work_dir = Path(argv[argv.index("--work-dir") + 1])
options = argv[argv.index("--cfg-options") + 1:]
calls = work_dir / "calls.txt"
first = not calls.exists()
with open(calls, "a") as f:
    f.write(" ".join(argv) + "\n")
print("stand-in training")
if {"optim.lr=3e-3", "model.hidden=64"} <= set(options) and first:
    print("rank 0, step 3: RuntimeError: injected failure", file=sys.stderr)
    sys.exit(1)
accuracy = 0.75 if "optim.lr=3e-3" in options else 0.25
with open(work_dir / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 20, "epoch": 1, "loss": 1.0 - accuracy}) + "\n")
    f.write(json.dumps({"step": 20, "mode": "val", "accuracy": accuracy}) + "\n")
