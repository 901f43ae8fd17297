"""What the guard costs a run: the same training with the guard and without it, in one process.

    python bench/guard.py [--model digits|tinylm] [--steps 400] [--rounds 5]
                          [--interval 10] [--checkpoint-interval 100]

Three variants train the same run, in turns, ``--rounds`` times each (the order rotating
from round to round, so that a warming machine favours none):

- ``off``: the runner's guard taken out (`Runner.guard` None, its hook removed): no look at
  any value, no look at the weights before a checkpoint. The baseline.
- ``stop``: the default guard (``nonfinite: stop``): the step's losses and gradient norm kept
  by reference, looked at every ``--interval`` steps (one copy to the host, one all_reduce of
  one number on several ranks) and before every checkpoint (the weights and optimiser state
  too).
- ``spike``: the same with a spike watch (``spike: {window: 100, action: warn}``): the
  losses' median on the host at each look (warned, not acted on: a small model near the end
  of its training has healthy losses 3 times their median).

Each round times ``train()`` alone (wall clock, after a warm-up round that is not counted);
the table gives each variant's median milliseconds a step and its ratio to ``off`` in the same
round (the median over the rounds, and the smallest and largest), and the spread of ``off``
itself (max/min over its rounds): a machine whose speed drifts moves both runs of a round
alike, and a median ratio inside the rounds' own range is within noise. ``in the guard``: the
share of ``train()``'s time spent inside the guard's own calls (its step hook, and its look
before each checkpoint), timed around them: what the guard costs, measured directly, however
noisy the machine. The run uses the GPU where there is one
(as every run does): there the steps that are not looked at must not wait for the device.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainrun.runner.runner import Runner

VARIANTS = {"off": None, "stop": {}, "spike": {"spike": {"window": 100, "action": "warn"}}}
MODELS = {
    "digits": ({"type": "DigitsMLP"}, {"type": "digits", "batch_size": 32}),
    "tinylm": ({"type": "TinyLM"}, {"type": "char_corpus", "split": "train", "block_size": 64,
                                    "batch_size": 32, "drop_last": True}),
}


def timed(method: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """``method``, adding the seconds each call takes to ``spent[0]``."""
    def call(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            spent[0] += time.perf_counter() - start
    return call


def train_once(model: str, guard: dict[str, Any] | None, steps: int, interval: int,
               checkpoint_interval: int, work_dir: Path) -> tuple[float, float]:
    """Seconds ``train()`` takes for ``steps`` steps of ``model`` with ``guard`` (None: the
    guard taken out), and the seconds of it spent in the guard's own calls (its step hook
    and its look before each checkpoint)."""
    model_cfg, data_cfg = MODELS[model]
    runner = Runner(model=model_cfg, work_dir=work_dir, train_dataloader=data_cfg,
                    optim={"type": "AdamW", "lr": 1e-3}, strategy="none",
                    schedule={"max_iters": steps}, randomness={"seed": 0},
                    logging={"interval": interval, "backends": ["jsonl"]},
                    checkpoint={"interval": checkpoint_interval, "save_last": False,
                                "max_keep": 1},
                    guard=guard or {})
    spent = [0.0]
    with runner:
        if guard is None:
            runner.hooks.remove(runner.guard)
            runner.guard = None
        else:  # (an instance attribute: the loop and the runner find it as the method)
            for name in ("after_train_iter", "may_save"):
                setattr(runner.guard, name, timed(getattr(runner.guard, name), spent))
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        runner.train()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="digits")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval", type=int, default=10, help="logging.interval")
    parser.add_argument("--checkpoint-interval", type=int, default=100)
    args = parser.parse_args()
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    own: dict[str, list[float]] = {name: [] for name in names}  # the guard's calls' share
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                seconds, spent = train_once(args.model, VARIANTS[name], args.steps,
                                            args.interval, args.checkpoint_interval,
                                            Path(tmp) / f"{name}{round_}")
                if round_:
                    times[name].append(seconds / args.steps)
                    own[name].append(spent / seconds)
    print(f"guard cost: {args.model}, {args.steps} steps, logged every {args.interval}, a "
          f"checkpoint every {args.checkpoint_interval}, {args.rounds} rounds, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'variant':<8} {'ms a step (median)':>19} {'ratio to off (median)':>22} "
          f"{'min':>6} {'max':>6} {'in the guard':>13}")
    for name in names:
        ratios = [mine / off for mine, off in zip(times[name], times["off"], strict=True)]
        print(f"{name:<8} {statistics.median(times[name]) * 1e3:>19.3f} "
              f"{statistics.median(ratios):>22.3f} {min(ratios):>6.3f} {max(ratios):>6.3f} "
              f"{statistics.median(own[name]):>12.2%}")
    spread = max(times["off"]) / min(times["off"])
    print(f"off's own spread over its rounds (max / min): {spread:.3f}")

if __name__ == "__main__":
    main()
