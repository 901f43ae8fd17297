"""The dry run of an MMEngine config: ``trainrun plan CONFIG.py`` (``trainrun train CONFIG.py
--dry-run``) checks it as the compat Runner would and prints what that Runner would run.

The config's runner arguments go through the same translation as ``Runner.from_cfg(cfg)``
(`check_arguments`, `runner_arguments`): what would be refused is refused, and the data sets
are built to count their samples, but no process group is joined, no model is built and
nothing is written.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from trainrun.compat.mmengine.runner import (
    FlexibleRunner,
    Runner,
    check_arguments,
    runner_arguments,
)


def runner_class(cfg: Mapping[str, Any]) -> type[Runner]:
    """The runner an MMEngine config asks for: FlexibleRunner where it gives a ``strategy``
    or names it in ``runner_type``, else Runner."""
    if "strategy" in cfg or cfg.get("runner_type") in ("FlexibleRunner", FlexibleRunner):
        return FlexibleRunner
    return Runner


class _Arguments:
    """Stands in for a runner while its ``__init__`` runs, keeping what that ``__init__``
    hands to ``_start``: the strategy section, the precision and MMEngine's arguments
    (with the launcher and strategy as that runner resolves them)."""

    def _start(self, strategy: Mapping[str, Any], precision: str | None,
               **arguments: Any) -> None:
        self.strategy, self.precision, self.arguments = dict(strategy), precision, arguments


def translate(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], _Arguments]:
    """The config's runner arguments checked and translated: (trainrun Runner's keyword
    arguments, what the runner's ``__init__`` made of MMEngine's arguments).

    Raises:
        ConfigError: what the compat Runner would refuse (named).
    """
    cls = runner_class(cfg)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "cfg"}
    held = _Arguments()
    cls.__init__(held, **{key: cfg[key] for key in cfg if key in accepted}, cfg=cfg)
    check_arguments(held.arguments)
    runner_kwargs, _ = runner_arguments(held.strategy, held.precision, held.arguments)
    return runner_kwargs, held


def _name(thing: Any) -> str:
    """A model, data set, hook or metric by its class name (``type`` for a config dict)."""
    if isinstance(thing, Mapping):
        kind = thing.get("type")
        return kind if isinstance(kind, str) else getattr(kind, "__name__", repr(kind))
    return type(thing).__name__


def _options(section: Mapping[str, Any] | None) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in (section or {}).items()) or "-"


def _schedulers(param_scheduler: Any) -> str:
    if param_scheduler is None:
        return "constant"
    items = param_scheduler if isinstance(param_scheduler, (list, tuple)) else [param_scheduler]
    described = []
    for item in items:
        options = {key: value for key, value in dict(item).items() if key != "type"}
        described.append(f"{_name(item)}({_options(options)})")
    return "; ".join(described)


def _loader(loader: DataLoader | None) -> str:
    if loader is None:
        return "none"
    sampler = loader.sampler
    shuffle = getattr(sampler, "shuffle", None)
    order = "" if shuffle is None else (" shuffled" if shuffle else " in order")
    return (f"{_name(loader.dataset)}, {len(loader.dataset)} samples, batch "
            f"{loader.batch_size} per process, {type(sampler).__name__}{order}, "
            f"{loader.num_workers} workers")


def describe(cfg: Mapping[str, Any], source: str) -> str:
    """What ``Runner.from_cfg(cfg).train()`` would run under trainrun, one line per part.

    Args:
        cfg: an MMEngine config (``Config`` or dict).
        source: where it came from, for the heading (its file).

    Raises:
        ConfigError: what the compat Runner would refuse (named).
    """
    runner_kwargs, held = translate(cfg)
    given, strategy = held.arguments, dict(held.strategy)
    strategy_type = strategy.pop("type")
    schedule = runner_kwargs["schedule"] or {}
    train = runner_kwargs["train_dataloader"]
    steps = ""
    if train is not None and "max_epochs" in schedule:
        steps = f" ({len(train)} iterations an epoch on one process)"
    start, load_from = runner_kwargs["resume"], runner_kwargs["load_from"]
    lines = [
        ("runner", f"{runner_class(cfg).__name__} (trainrun.compat.mmengine)"),
        ("model", _name(given["model"])),
        ("launcher", f"{given['launcher']}"),
        ("strategy", f"{strategy_type} ({_options(strategy)})"),
        ("precision", runner_kwargs["precision"]),
        ("optimiser", _options(runner_kwargs["optim"])),
        ("schedule", _options(schedule) + steps),
        ("lr schedule", _schedulers(given["param_scheduler"])),
        ("train data", _loader(train)),
        ("val data", _loader(runner_kwargs["val_dataloader"])),
        ("test data", _loader(runner_kwargs["test_dataloader"])),
        ("val metrics", ", ".join(_name(m) for m in runner_kwargs["val_metrics"] or []) or "-"),
        ("checkpoint", _options(runner_kwargs["checkpoint"])),
        ("logging", _options(runner_kwargs["logging"]) if runner_kwargs["logging"]
         else "trainrun's defaults"),
        ("custom hooks", ", ".join(_name(h) for h in given["custom_hooks"] or []) or "-"),
        ("randomness", _options(runner_kwargs["randomness"])),
        ("start", f"resume from {start}" if isinstance(start, str) else
         "resume from the newest checkpoint in work_dir" if start else
         f"weights from {load_from}" if load_from else "fresh"),
        ("work_dir", f"{runner_kwargs['work_dir'].path} (MMEngine's layout: epoch_N.pth / "
                     f"iter_N.pth and last_checkpoint)"),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join([f"plan of {source} (an MMEngine config; nothing started or written):",
                      *(f"  {name:<{width}}  {text}" for name, text in lines)])
