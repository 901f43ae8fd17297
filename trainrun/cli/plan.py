"""The plan ``--dry-run`` prints: who runs where, with what batch, for how many steps.

Everything comes from the validated config and the launcher's environment variables; nothing
is initialised and nothing is written. ``trainrun plan CONFIG ...`` is ``trainrun train
CONFIG ... --dry-run``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainrun.dist import get_device
from trainrun.dist.launch import (
    STARTERS,
    WORLD_SIZE_VARS,
    announced_rank,
    announced_world_size,
    resolve_backend,
)
from trainrun.messages import show
from trainrun.runner.hooks.base import SLOTS
from trainrun.runner.hooks.from_config import planned_order
from trainrun.runner.sampler import batches_per_epoch
from trainrun.wrappers.memory import KINDS, LABELS, StateBytes, human


def env_world_size(launcher: str) -> tuple[int, str]:
    """The world size ``launcher``'s variables announce, and a note on where it came from."""
    if launcher not in WORLD_SIZE_VARS:
        return 1, "launcher none"
    found = announced_world_size(launcher)
    if found is None:
        names = " / ".join(WORLD_SIZE_VARS[launcher])
        return 1, f"{names} not set: not started by {STARTERS[launcher]}; showing 1"
    return found[0], f"from {found[1]}"


def env_rank(launcher: str) -> int:
    """This process's rank as ``launcher``'s variables announce it (0 when they do not)."""
    return announced_rank(launcher) or 0


def _show(value: Any) -> str:
    return value if isinstance(value, str) else show(value)  # a plan's strings go unquoted


def _options(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_show(v)}" for k, v in options.items() if k != "type")


def _with_options(section: Mapping[str, Any]) -> str:
    options = _options(section)
    return section["type"] + (f" ({options})" if options else "")


def _data(section: Mapping[str, Any], length: str | None = None) -> str:
    """A data section's type, its length where known, and its collate function if not the
    default."""
    text = section["type"] + (f", {length}" if length else "")
    collate = section.get("collate_fn")
    if collate:
        text += ", collate_fn " + (collate if isinstance(collate, str) else _with_options(collate))
    return text


def _resume(resume: bool | str) -> str:
    if isinstance(resume, str):
        return resume
    return "from the newest checkpoint in work_dir" if resume else "no"


def _backend(cfg: Mapping[str, Any]) -> str:
    try:
        resolved = resolve_backend(cfg["backend"])
    except ValueError as error:
        return f"{cfg['backend']} (not usable here: {error})"
    text = f"{resolved} (auto)" if cfg["backend"] == "auto" else resolved
    return text + (" (unused: launcher none joins no group)" if cfg["launcher"] == "none" else "")


def _compile(cfg: Mapping[str, Any]) -> str:
    """What is compiled (the strategy says) and with which options."""
    if not cfg.get("compile"):
        return "no"
    from trainrun.registry import STRATEGIES

    where = STRATEGIES[cfg["strategy"]["type"]].COMPILES
    return f"{where}; {_options(cfg['compile'])} (at the first step)"


def _devices(launcher: str, world_size: int) -> str:
    device = get_device()
    if device == "cuda":
        import torch

        return (f"cuda: one GPU per rank (cuda:LOCAL_RANK), {torch.cuda.device_count()} "
                f"visible here" if launcher != "none" else "cuda:0")
    return device if world_size == 1 else f"{device} on each of {world_size} processes"


def _unit(schedule: Mapping[str, Any], count: int) -> str:
    unit = "epoch" if schedule["max_epochs"] is not None else "iteration"
    return f"{count} {unit}" + ("s" if count != 1 else "")


def _steps(cfg: Mapping[str, Any], world_size: int, dataset_length: int | None) -> str:
    train, schedule = cfg["data"]["train"], cfg["schedule"]
    accumulate = cfg["optim"]["accumulate"]
    per_epoch = None if dataset_length is None else batches_per_epoch(
        dataset_length, world_size, train["batch_size"], train["drop_last"])
    if schedule["max_iters"] is not None:
        total = schedule["max_iters"]
        epochs = "" if not per_epoch else f" (about {total / per_epoch:.1f} epochs)"
        head = f"{per_epoch if per_epoch is not None else 'unknown'} per epoch; "
        return f"{head}{total} in all{epochs}; {total // accumulate} optimiser steps"
    if per_epoch is None:
        return f"unknown (the train set's size is unknown) over {schedule['max_epochs']} epochs"
    total = per_epoch * schedule["max_epochs"]
    return (f"{per_epoch} per epoch; {total} in all over {schedule['max_epochs']} epochs; "
            f"{total // accumulate} optimiser steps")


def _val_set(val: Mapping[str, Any]) -> str:
    metrics = ", ".join(val["metrics"]) if val["metrics"] else "the data set's default"
    return f"{_data(val)} (batch {val['batch_size']} per rank; metrics: {metrics})"


def _validation(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The validation row; with several sets, a row for each after it."""
    val = cfg["data"]["val"]
    if val is None:
        return [("validation", "none (data.val is null)")]
    every = f"every {_unit(cfg['schedule'], cfg['schedule']['val_interval'])}"
    if "type" in val:
        return [("validation", f"{every} on {_val_set(val)}")]
    return [("validation", f"{every} on {len(val)} sets, logged as val/<name>/<metric>:"),
            *((f"  val/{name}", _val_set(section)) for name, section in val.items())]


def _optimiser(optim: Mapping[str, Any]) -> str:
    arguments = {k: v for k, v in optim.items() if k not in ("clip_grad", "accumulate",
                                                              "per_module", "paramwise")}
    clip = optim["clip_grad"]
    text = (f"{_with_options(arguments)}; accumulate {optim['accumulate']}; clip_grad "
            + (_options(clip) if clip else "none"))
    per_module = [f"{name} ({_options(overrides) or 'shared options'})"
                  for name, overrides in (optim["per_module"] or {}).items()]
    return text + (f"; per module: {', '.join(per_module)}" if per_module else "")


def _groups(groups: Sequence[str] | str) -> str:
    """The param groups row: how many, then one line each (or why they are not listed)."""
    if isinstance(groups, str):
        return groups
    count = (f"{len(groups)} group{'s' if len(groups) != 1 else ''} (optim.paramwise; counted "
             f"on the model built on the meta device)")
    return "\n".join([count, *groups])


NOT_COUNTED = ("not counted: activations, temporary buffers (communication, gathered "
               "parameters), the CUDA context, allocator fragmentation")


def _bytes(state: StateBytes, where: dict[str, int]) -> str:
    parts = [f"{LABELS[kind]} {human(where[kind])}" for kind in KINDS]
    if not state.optim_known:
        parts[-1] = "optimiser state not known (this plan does not know the optimiser's)"
    return ", ".join(parts)


def _memory(state: StateBytes | str, world_size: int) -> str:
    """The memory rows: per rank by kind (device, then CPU where offloaded), the rank's and
    the job's totals, the strategy's notes, and what is not counted."""
    if isinstance(state, str):
        return state
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    lines = [f"per rank: {_bytes(state, state.device)}"]
    if any(state.cpu.values()):
        lines.append(f"per rank on the CPU (offloaded): {_bytes(state, state.cpu)}")
    unknown = "" if state.optim_known else " + the optimiser's state"
    lines += [f"total: {human(state.total)} per rank{unknown}; {human(state.total * world_size)}"
              f" for the job ({ranks}){unknown}", *state.notes, NOT_COUNTED]
    return "\n".join(lines)


def _checkpoints(cfg: Mapping[str, Any]) -> str:
    ckpt = cfg["checkpoint"]
    every = (f"every {_unit(cfg['schedule'], ckpt['interval'])}" if ckpt["interval"]
             else "no periodic checkpoints")
    keep = "all" if ckpt["max_keep"] == -1 else str(ckpt["max_keep"])
    best = (f"best by {ckpt['save_best']} ({ckpt['best_rule']})" if ckpt["save_best"]
            else "no best")
    return f"{every}, keep {keep}, save last: {_show(ckpt['save_last'])}, {best}"


def _hooks(cfg: Mapping[str, Any]) -> str:
    """Every hook in the order it runs (built-in ones by their slot's name)."""
    builtin = [name for name in ("timer", "logger", "validation", "checkpoint", "preemption")
               if name != "validation" or cfg["data"]["val"] is not None]
    rows = planned_order([(name, SLOTS[name]) for name in builtin], cfg.get("hooks") or [])
    return ", ".join(f"{_with_options(item)} [{number}]" for number, item in rows)


def describe_plan(cfg: DictConfig | Mapping[str, Any], world_size: int | None = None,
                  dataset_length: int | None = None,
                  param_groups: Sequence[str] | str | None = None,
                  memory: StateBytes | str | None = None) -> str:
    """The resolved plan of a validated config, as lines of text.

    ``world_size`` defaults to what the launcher's variables announce; ``dataset_length`` is
    the train set's length (None: steps per epoch are shown as unknown); ``param_groups``:
    a line per parameter group ``optim.paramwise`` makes, or why they are not listed (None:
    no such row); ``memory``: each rank's bytes of training state (`Strategy.memory_plan`),
    or why it is not planned (None: no such row).
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    note = "given"
    if world_size is None:
        world_size, note = env_world_size(cfg["launcher"])
    train, optim = cfg["data"]["train"], cfg["optim"]
    batch = train["batch_size"]
    effective = batch * world_size * optim["accumulate"]
    schedule = cfg["schedule"]
    length = "size unknown" if dataset_length is None else f"{dataset_length} items"
    rows = [
        ("launcher", cfg["launcher"]),
        ("world size", f"{world_size} ({note})"),
        ("backend", _backend(cfg)),
        ("strategy", _with_options(cfg["strategy"])),
        ("devices", _devices(cfg["launcher"], world_size)),
        ("model", cfg["model"]["type"]),
        ("train data", _data(train, length)),
        ("batch size", f"{batch} per rank; effective {batch} x {world_size} ranks x "
                       f"{optim['accumulate']} accumulated = {effective}"),
        ("iterations", _steps(cfg, world_size, dataset_length)),
        ("schedule", _unit(schedule, schedule["max_epochs"] or schedule["max_iters"])),
        *_validation(cfg),
        ("optimiser", _optimiser(optim)),
        *([("param groups", _groups(param_groups))] if param_groups is not None else []),
        ("scheduler", _with_options(cfg["scheduler"]) if cfg["scheduler"]
         else "none (constant learning rate)"),
        ("precision", cfg["precision"]),
        *([("memory", _memory(memory, world_size))] if memory is not None else []),
        ("compile", _compile(cfg)),
        ("seed", _options(cfg["randomness"])),
        ("checkpoints", _checkpoints(cfg)),
        ("hooks", _hooks(cfg)),
        ("resume", _resume(cfg["resume"])),
        ("load_from", cfg["load_from"] or "none"),
        ("work_dir", f"{cfg['work_dir']} (not created by a dry run)"),
    ]
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"plan for {cfg['name']!r} (dry run: nothing is trained or written)"]
    lines += [f"  {label.ljust(width)}{value}".replace("\n", "\n" + " " * (width + 4))
              for label, value in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``trainrun plan``: the plan of ``trainrun train`` with the same arguments; returns the
    exit code (2 for a config the run would refuse)."""
    from trainrun.cli import train  # train prints its --dry-run plan with this module

    args = list(sys.argv[1:] if argv is None else argv)
    return train.main(args if "--dry-run" in args else [*args, "--dry-run"], command_name="plan")
