"""The plan ``--dry-run`` prints: who runs where, with what batch, for how many steps, the
optimiser's parameter groups and each rank's memory.

Everything comes from the validated config and the launcher's environment variables, from
the model built on the meta device (shapes without memory or weights), and from the config's
hooks built and checked against what the config says of the run; nothing is initialised and
nothing is written. ``trainrun train CONFIG ... --dry-run`` (and ``trainrun plan``, the
same) prints it: ``make_plan`` checks what the run would refuse, ``describe_plan`` writes
the text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import IterableDataset

from trainrun.dist import get_device
from trainrun.dist.launch import (
    STARTERS,
    WORLD_SIZE_VARS,
    announced_rank,
    announced_world_size,
    resolve_backend,
)
from trainrun.messages import first_line, human, show
from trainrun.registry import STRATEGIES, resolve
from trainrun.runner.builder import build_metrics, build_model, check_batches, data_sections
from trainrun.runner.config import dataset_kwargs
from trainrun.runner.hooks.base import SLOTS
from trainrun.runner.hooks.from_config import build_hook, check_built_hook, planned_order
from trainrun.runner.hooks.guard import check_guard
from trainrun.runner.optim.factory import (
    GROUP_KEYS,
    WRAPPER_KEYS,
    optimizer_factory,
    own_options,
    state_tensors,
)
from trainrun.runner.optim.param_groups import uses_paramwise
from trainrun.runner.optim.schedulers import check_floors
from trainrun.runner.sampler import batches_per_epoch
from trainrun.runner.schema import ConfigError
from trainrun.wrappers.memory import KINDS, LABELS, StateBytes, param_specs


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


# ---------------------------------------------------------------- what the built parts say

def build_meta_model(cfg: Mapping[str, Any]) -> nn.Module | Exception:
    """The config's model built on the meta device (shapes without memory or weights: a
    7B-parameter model in seconds), or the error that stopped it (a config error raises):
    what the dry run plans parameter groups and memory on."""
    try:
        with torch.device("meta"):
            return build_model(cfg["model"])
    except ConfigError:
        raise
    except Exception as error:  # a plan reports what it cannot know, it does not fail
        return error


def plan_param_groups(cfg: Mapping[str, Any], model: nn.Module | Exception | None = None
                      ) -> tuple[list[str] | str | None, list[str]]:
    """The lines the run's log will list of its parameter groups, and the warnings about
    them, for the dry run: its optimiser(s) over the model built on the meta device
    (``model``, built here where not given). None where no ``paramwise`` is set; for a model
    that cannot be built there, a line saying so instead of the list (a config error
    raises)."""
    optim = cfg["optim"]
    if not uses_paramwise(optim):
        return None, []
    lines: list[str] = []
    warnings: list[str] = []
    model = build_meta_model(cfg) if model is None else model
    if isinstance(model, Exception):
        return _groups_not_listed(model), []
    try:
        with torch.device("meta"):
            optimizers = optimizer_factory(optim, warnings.append, lines.extend)(model)
        for optimizer in optimizers.values() if isinstance(optimizers, Mapping) \
                else [optimizers]:
            check_floors(cfg.get("scheduler"), optimizer)
    except ConfigError:
        raise
    except ValueError as error:
        if str(error).startswith("scheduler."):  # a min_lr above a group's rate
            raise ConfigError(str(error)) from None
        return _groups_not_listed(error), []
    except Exception as error:  # a plan reports what it cannot know, it does not fail
        return _groups_not_listed(error), []
    return lines, warnings


# ---------------------------------------------------------------- the hooks' checks

class NotPlanned(AttributeError):
    """A part of the run that a dry run does not build (an AttributeError, so that
    ``getattr(runner, name, default)`` takes the default)."""


class _Unbuilt:
    """A part of the run that exists (a validation loader) but is not built by a dry run:
    any use of it is `NotPlanned`."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise NotPlanned(f"{self._what} is not built by a dry run")

    def __len__(self) -> int:
        raise NotPlanned(f"{self._what} is not built by a dry run")

    def __iter__(self) -> Any:
        raise NotPlanned(f"{self._what} is not built by a dry run")


class PlannedRun:
    """What a hook's ``check`` can know of the run from its config alone: the dry run's
    stand-in for the built ``Runner``. It has ``cfg``, ``rank``, ``world_size`` (where the
    launcher's variables or ``--nproc`` say it), ``val_dataloader`` (None without
    validation, else a loader that is not built) and ``val_metrics`` (built from the config
    where its metrics can be); anything else is `NotPlanned`, and a check that needs it is
    left to the run.

    Args:
        cfg: the validated config, as plain containers.
        world_size: the ranks planned for; None where unknown.
        rank: this process's rank.
    """

    def __init__(self, cfg: Mapping[str, Any], world_size: int | None, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        if world_size is not None:
            self.world_size = world_size
        val = cfg["data"].get("val")
        self.val_dataloader: Any = None if not val else (
            {name: _Unbuilt(f"data.val.{name}") for name in val} if "type" not in val
            else _Unbuilt("data.val"))
        metrics = _planned_val_metrics(cfg)
        if metrics is not None:
            self.val_metrics = metrics

    def __getattr__(self, name: str) -> Any:
        raise NotPlanned(f"the run's {name} is not built by a dry run")


def _planned_val_metrics(cfg: Mapping[str, Any]) -> Any:
    """The validation metrics the runner builds from the config (a list; a dict of them by
    set for several sets), or None where one cannot be built here."""
    found: dict[str, list[Any]] = {}
    try:
        for key, section in data_sections({"val": cfg["data"].get("val")}):
            found[key] = build_metrics(section, resolve("dataset", section["type"]), key)
    except Exception:  # a plan reports what it cannot know, it does not fail
        return None
    if list(found) == ["data.val"]:
        return found["data.val"]
    return {key.removeprefix("data.val."): metrics for key, metrics in found.items()}


def check_planned_hooks(cfg: Mapping[str, Any], run: PlannedRun) -> None:
    """Build each hook of the config's ``hooks`` list and check it against ``run`` as the run
    checks it once built (`Hook.check`), raising the same ConfigError; a check that needs a
    part of the run the dry run does not build is left to the run. Nothing is started."""
    for i, item in enumerate(cfg.get("hooks") or []):
        key = f"hooks[{i}]"
        hook = build_hook(key, item, [])  # the config's check already said its warnings
        try:
            check_built_hook(key, hook, run)
        except ConfigError:
            raise
        except Exception:  # it needs what only the built run has: the run checks it
            continue


def plan_memory(cfg: Mapping[str, Any], world_size: int,
                model: nn.Module | Exception | None = None) -> StateBytes | str:
    """The most bytes of parameters, gradients and optimiser state a rank of ``world_size``
    will hold, as the config's strategy plans them (`Strategy.memory_plan`) on the model
    built on the meta device (``model``, built here where not given); or why not. An option
    the model refuses is a ConfigError, as the run would refuse it."""
    model = build_meta_model(cfg) if model is None else model
    if isinstance(model, Exception):
        return (f"not planned: the model cannot be built on the meta device "
                f"({type(model).__name__}: {first_line(model)})")
    specs = param_specs(model, _state_tensors_per_param(cfg["optim"]))
    try:
        plan = STRATEGIES[cfg["strategy"]["type"]].memory_plan(specs, world_size, cfg, model)
    except ValueError as error:  # an option the model refuses (fsdp's wrap classes)
        raise ConfigError(first_line(error)) from None
    total = sum(spec.numel for spec in specs)
    trainable = sum(spec.numel for spec in specs if spec.trainable)
    share = "all" if trainable == total else f"{trainable:,}"
    plan.notes.insert(0, f"{total:,} parameters ({share} trainable), counted on the model "
                         f"built on the meta device")
    return plan


def _state_tensors_per_param(optim: Mapping[str, Any]) -> Callable[[str], int | None]:
    """The optimiser state tensors of a parameter, by its name (``state_tensors`` of the
    optimiser holding it; 0 where none does)."""
    common = {k: v for k, v in optim.items() if k not in WRAPPER_KEYS and v is not None}
    per_module = optim.get("per_module") or {}

    def states(name: str) -> int | None:
        if not per_module:
            return state_tensors(common)
        head = name.partition(".")[0]
        if head not in per_module:
            return 0
        return state_tensors({**common, **own_options(per_module[head])})

    return states


def _groups_not_listed(error: Exception) -> str:
    return (f"not listed here: the model cannot be built on the meta device "
            f"({type(error).__name__}: {first_line(error)}); the run's log lists them")


def train_set_length(cfg: DictConfig) -> tuple[int | None, str | None]:
    """The train set's length, built through ``trainrun.registry.resolve``, or None and why."""
    train = cfg.data.train
    try:
        dataset = resolve("dataset", train.type)(**dataset_kwargs(train))
        if isinstance(dataset, IterableDataset):  # dealt to ranks in rounds, not by a sampler
            return None, f"data.train is a stream ({type(dataset).__name__}, an IterableDataset)"
        return len(dataset), None
    except Exception as error:  # a plan reports what it cannot know, it does not fail
        return None, (f"could not build data.train: {type(error).__name__}: "
                      f"{first_line(error)}")


@dataclass
class Plan:
    """What a dry run finds beyond the config checks: the train set's length (or why it is
    unknown), the parameter groups, the memory per rank, and warnings about them."""

    world_size: int
    length: int | None
    why: str | None
    groups: Any
    memory: Any
    warnings: list[str]


def _model_parallel(cfg: Mapping[str, Any], peers: int) -> str:
    """The ranks that hold one copy of the model between them, in words: 'tp 2', 'tp 2 x pp
    2' (strategy 'fsdp''s options)."""
    pp = (cfg.get("strategy") or {}).get("pp", 1)
    return f"tp {peers // pp} x pp {pp}" if pp > 1 else f"tp {peers}"


def data_ranks(cfg: Mapping[str, Any], world_size: int) -> int:
    """The ranks the training data is dealt to among ``world_size``: fewer where the
    strategy's ranks share batches (``model_parallel_size``, tensor parallelism)."""
    strategy = STRATEGIES[cfg["strategy"]["type"]]
    peers = strategy(**strategy.options_in(cfg)).model_parallel_size
    return world_size // peers if peers >= 1 and world_size % peers == 0 else world_size


def make_plan(cfg: DictConfig, world_size: int | None = None) -> Plan:
    """The dry run's checks on the built parts: a training set that leaves no batch,
    options the model (built on the meta device) refuses, and a hook's options that building
    it, or its check against what the config says of the run, refuses (a Profiler's rank
    beyond the world size, an EarlyStopping metric the validation metrics do not name), raise
    ConfigError, as the run would refuse them.

    Args:
        cfg: the validated config.
        world_size: the ranks to plan for (``--world-size``, ``--nproc``); None: as many as
            the launcher's variables announce.

    Returns:
        What the dry run prints beside the config (``describe_plan`` takes it).

    Raises:
        ConfigError: what the run would refuse.
    """
    known = world_size or (env_world_size(cfg.launcher)[0]
                           if cfg.launcher not in WORLD_SIZE_VARS
                           or announced_world_size(cfg.launcher) else None)
    world_size = known or 1
    length, why = train_set_length(cfg)
    if length is not None:
        train = cfg.data.train
        check_batches("data.train", length, data_ranks(cfg, world_size), train.batch_size,
                      train.drop_last)
    plain = OmegaConf.to_container(cfg, resolve=True)
    model = build_meta_model(plain)  # once, for the groups and the memory plan
    groups, warnings = plan_param_groups(plain, model)
    memory = plan_memory(plain, world_size, model)
    check_planned_hooks(plain, PlannedRun(plain, known, env_rank(cfg.launcher)))
    return Plan(world_size, length, why, groups, memory, warnings)


# ---------------------------------------------------------------- the plan as text

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
    where = STRATEGIES[cfg["strategy"]["type"]].COMPILES
    return f"{where}; {_options(cfg['compile'])} (at the first step)"


def _devices(launcher: str, world_size: int) -> str:
    device = get_device()
    if device == "cuda":
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
    begin = cfg["schedule"].get("val_begin", 1)
    if begin > 1:
        every += f" from {'epoch' if cfg['schedule']['max_epochs'] is not None else 'iteration'}" \
                 f" {begin} on"
    if "type" in val:
        return [("validation", f"{every} on {_val_set(val)}")]
    return [("validation", f"{every} on {len(val)} sets, logged as val/<name>/<metric>:"),
            *((f"  val/{name}", _val_set(section)) for name, section in val.items())]


def _optimiser(optim: Mapping[str, Any]) -> str:
    arguments = {k: v for k, v in optim.items() if k not in (*WRAPPER_KEYS, *GROUP_KEYS)}
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


def _guard(cfg: Mapping[str, Any]) -> str:
    """What a run that goes wrong numerically makes training do (the ``guard`` section)."""
    guard = check_guard("guard", cfg.get("guard"))
    spike = guard["spike"]
    rolls = "rollback" in (guard["nonfinite"], spike and spike["action"])
    text = f"nonfinite: {guard['nonfinite']}; spike: " + (
        f"above {spike['factor']:g} x the median of {spike['window']} steps: "
        f"{spike['action']}" if spike else "off")
    if rolls:
        text += (f"; a rollback skips {guard['skip_batches']} batches past the bad one, "
                 f"{guard['max_rollbacks']} in a row at most")
    return text


def _hooks(cfg: Mapping[str, Any]) -> str:
    """Every hook in the order it runs (built-in ones by their slot's name)."""
    builtin = [name for name in ("timer", "logger", "guard", "validation", "checkpoint",
                                 "preemption")
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
    batch, data = train["batch_size"], data_ranks(cfg, world_size)
    effective = batch * data * optim["accumulate"]
    ranks = f"{world_size} ranks" if data == world_size else \
        f"{data} data-parallel ranks ({world_size} / {_model_parallel(cfg, world_size // data)})"
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
        ("batch size", f"{batch} per rank; effective {batch} x {ranks} x "
                       f"{optim['accumulate']} accumulated = {effective}"),
        ("iterations", _steps(cfg, data, dataset_length)),
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
        ("guard", _guard(cfg)),
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
