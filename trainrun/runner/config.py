"""The run's config: YAML through OmegaConf, dotlist overrides, interpolation, validation.

`load_config` reads the file with OmegaConf's safe YAML loader (no tag builds a Python
object), merges it over the files its ``_base_`` names (`inherit.py`), merges ``key=value``
overrides, resolves interpolations such as ``${name}`` and then checks every section against
its table, filling defaults (each table lives beside the code that uses the section;
`schema.py` says how one is written). Every error is one line that names the dotted key, the
bad value and what was expected. Interpolations see only the keys written in the files or the
overrides: defaults are filled after resolution.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainrun.dist import launch
from trainrun.dist.timeouts import DEFAULT_TIMEOUT
from trainrun.messages import first_line, show
from trainrun.registry import STRATEGIES
from trainrun.runner.builder import LOADER_KEYS as LOADER_KEYS  # re-exported
from trainrun.runner.builder import LOADER_OPTIONS, check_data, check_model_section
from trainrun.runner.hooks.checkpoint import check_best_metric, check_checkpoint_section
from trainrun.runner.hooks.from_config import check_hooks
from trainrun.runner.hooks.guard import check_guard
from trainrun.runner.hooks.logger import check_logging
from trainrun.runner.inherit import MARKERS, read_with_bases
from trainrun.runner.loops import check_schedule
from trainrun.runner.optim.schedulers import check_scheduler, check_total_iters
from trainrun.runner.optim.section import check_optim_section
from trainrun.runner.optim.wrapper import PRECISIONS
from trainrun.runner.preemption import check_preemption
from trainrun.runner.schema import (
    REQUIRED,
    ConfigError,
    Fields,
    bad_value,
    check_bool,
    check_text,
    choice,
    existing_path,
    expects,
    fields,
    join,
    nullable,
    number,
    unknown_key,
)
from trainrun.runner.seed import check_randomness
from trainrun.wrappers.base import COMPILE_BACKENDS, COMPILE_DEFAULTS, COMPILE_MODES

log = logging.getLogger("trainrun")

LAUNCHERS = ("none", *launch.LAUNCHERS)  # none: one plain process, nothing to join
DEFAULT_DIST_TIMEOUT = int(DEFAULT_TIMEOUT.total_seconds())  # seconds: dist's (30 min)


def check_strategy(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    """The chosen strategy with its options; another strategy's options are dropped with a
    warning, so ``strategy.type=X`` on a config written for another strategy works."""
    if isinstance(value, str):
        value = {"type": value}
    value = fields(key, value, {"type": ("ddp", choice(*STRATEGIES))}, open_=True)
    name = value.pop("type")
    options = STRATEGIES[name].OPTIONS
    for option in [o for o in value if o not in options]:
        owners = [other for other, cls in STRATEGIES.items() if option in cls.OPTIONS]
        if not owners:
            known = dict.fromkeys(["type", *options, *(o for cls in STRATEGIES.values()
                                                     for o in cls.OPTIONS)])
            raise unknown_key(key, option, known)
        owner = "/".join(repr(o) for o in owners)
        warnings.append(f"{join(key, option)} is a {owner} option; ignored for {name!r}")
    return {"type": name, **{o: value.get(o, default) for o, default in options.items()}}


def check_resume(key: str, value: Any) -> bool | str:
    if value is None or isinstance(value, bool):
        return bool(value)
    if not isinstance(value, str):
        raise bad_value(key, value, "false, true or a checkpoint path")
    return existing_path(key, value)


check_resume.expected = "false, true or a checkpoint path"  # type: ignore[attr-defined]


COMPILE: Fields = {
    "backend": (COMPILE_DEFAULTS["backend"], choice(*COMPILE_BACKENDS),
                "torch.compile's backend: inductor generates code; aot_eager and eager only "
                "check that the model compiles"),
    "mode": (COMPILE_DEFAULTS["mode"], choice(*COMPILE_MODES), "inductor's mode"),
    "fullgraph": (COMPILE_DEFAULTS["fullgraph"], check_bool,
                  "a graph break is an error instead of two graphs"),
    "dynamic": (COMPILE_DEFAULTS["dynamic"], nullable(check_bool),
                "dynamic shapes: null lets torch decide (dynamic after a shape changes)"),
}


def check_compile(key: str, value: Any) -> dict[str, Any] | bool:
    """``false`` (no compiling), or torch.compile's options: ``true`` is every default."""
    if value is None or value is False:
        return False
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, "false, true or a mapping of backend, mode, fullgraph "
                                    "and dynamic")
    options = fields(key, value, COMPILE)
    if options["backend"] != "inductor" and options["mode"] != "default":
        raise ConfigError(f"{key}.mode: got {show(options['mode'])}, but modes are "
                          f"inductor's; {key}.backend is {options['backend']!r}")
    return options


check_compile.expected = "false, true or a mapping"  # type: ignore[attr-defined]


def top_level(mode: str, warnings: list[str]) -> Fields:
    """The table of the whole config (``work_dir``'s default is filled from ``name``)."""
    return {
        "name": (REQUIRED, check_text,
                 "the run's name (default: the config file's name without .yaml)"),
        "work_dir": (None, nullable(check_text),
                     "the run directory (default: work_dirs/<name>); --work-dir wins"),
        "launcher": ("none", choice(*LAUNCHERS),
                     "how the processes were started: none (one plain process), pytorch "
                     "(torchrun), slurm (srun), mpi (mpirun); --launcher wins"),
        "backend": ("auto", choice(*launch.BACKENDS),
                    "the communication backend (auto: nccl with CUDA, else gloo)"),
        "dist_timeout": (DEFAULT_DIST_TIMEOUT, number(above=0),
                         "seconds any collective, and a silent rank, may take before the job "
                         "ends naming it"),
        "strategy": (None, expects("a strategy's name, or a mapping with its type and options",
                                   partial(check_strategy, warnings=warnings)),
                     "how the model is spread over the ranks (see strategy below)"),
        "model": (REQUIRED, check_model_section, "the model: its type and arguments"),
        "data": (REQUIRED, expects("a mapping of train, val and test sections",
                                   partial(check_data, mode=mode, warnings=warnings)),
                 "the train, val and test data sections"),
        "optim": (None, expects("a mapping", check_optim_section),
                  "the optimiser and its wrapper's options"),
        "scheduler": (None, expects("null or a mapping with a 'type'",
                                    lambda key, value: check_scheduler(value, key)),
                      "the learning-rate schedule (null: a constant rate)"),
        "precision": ("fp32", choice(*PRECISIONS),
                      "fp32, or autocast to bf16 or fp16 (fp16 with a gradient scaler); "
                      "--amp sets bf16"),
        "compile": (False, check_compile,
                    "torch.compile the model: false, true, or its options (see compile below)"),
        "schedule": (None, expects("a mapping", check_schedule),
                     "how long to train and how often to validate"),
        "randomness": (None, check_randomness, "seeds and determinism"),
        "logging": (None, expects("a mapping", partial(check_logging, warnings=warnings)),
                    "what is logged, how often and where"),
        "checkpoint": (None, expects("a mapping",
                                     partial(check_checkpoint_section, warnings=warnings)),
                       "when checkpoints are written and how many are kept"),
        "preemption": (None, check_preemption, "which signals stop training with a checkpoint"),
        "guard": (None, check_guard, "what a run that goes wrong numerically (a value that is "
                  "not finite, a loss spike) makes training do"),
        "hooks": ([], expects("a list of mappings", partial(check_hooks, warnings=warnings)),
                  "more hooks: a list of {type: ..., options}"),
        "resume": (False, check_resume,
                   "false, true (the newest checkpoint in work_dir) or a checkpoint path; "
                   "--resume sets it"),
        "load_from": (None, nullable(existing_path),
                      "a checkpoint to start from, its model weights only"),
    }


MODES = ("train", "test")


def check(data: Any, mode: str = "train") -> tuple[dict[str, Any], list[str]]:
    """The plain, resolved config checked and completed, and the warnings about it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    warnings: list[str] = []
    out = fields("", data, top_level(mode, warnings))
    if out["work_dir"] is None:
        out["work_dir"] = f"work_dirs/{out['name']}"
    val = out["data"]["val"]
    check_best_metric("checkpoint.save_best", out["checkpoint"]["save_best"],
                      list(val) if val and "type" not in val else None)
    if out["schedule"]["max_iters"] is not None:
        check_total_iters(out["scheduler"], out["schedule"]["max_iters"],
                          total_name="schedule.max_iters")
    strategy = STRATEGIES[out["strategy"]["type"]]
    if out["compile"] and strategy.COMPILES is None:
        raise ConfigError(f"compile: strategy {strategy.name!r} does not compile models; "
                          f"set compile: false")
    try:
        strategy.check_config(out)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return out, warnings


# ---------------------------------------------------------------- loading

def _to_plain(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg) if isinstance(cfg, Mapping) else cfg


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error: its key and its first line."""
    message = first_line(getattr(error, "msg", None) or error)
    key = getattr(error, "full_key", None)
    return f"{key}: {message}" if key else message


def read_yaml(path: str | os.PathLike[str], shown: str | None = None) -> DictConfig:
    """The file's own mapping (its ``_base_`` not followed), with OmegaConf's safe loader:
    tags that build objects are refused. Errors name ``shown`` (default: the path)."""
    path = Path(path)
    shown = str(path) if shown is None else shown
    if not path.is_file():
        raise ConfigError(f"config file not found: {str(path)!r}")
    try:
        cfg = OmegaConf.load(path)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{shown}:{mark.line + 1}" if mark else shown
        problem = (error.problem or error.context or "invalid YAML").replace("\n", " ")
        if "constructor for the tag" in problem:
            problem += " (tags that build Python objects are not allowed)"
        raise ConfigError(f"{where}: {problem}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{shown}: {first_line(error)}") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{shown}: {_omegaconf_message(error)}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{shown}: cannot read the config: {error}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{shown}: got a {type(cfg).__name__} at the top level, "
                          f"expected a mapping of keys")
    return cfg


def read_config(path: str | os.PathLike[str]) -> DictConfig:
    """The file's mapping merged over its ``_base_`` files (`inherit.py`), unresolved."""
    return read_with_bases(path, read_yaml)


def parse_override(override: str) -> DictConfig:
    """One ``key.sub=value`` override (the value is YAML) as a config to merge."""
    key, equals, _ = str(override).partition("=")
    parts = key.strip().split(".")
    if not equals or not all(part.strip() for part in parts):
        raise ConfigError(f"override {override!r}: expected key=value with a dotted key, "
                          f"e.g. optim.lr=0.01")
    marker = next((part.strip() for part in parts if part.strip() in MARKERS), None)
    if marker:
        raise ConfigError(f"override {override!r}: {marker} works only inside a config file")
    try:
        return OmegaConf.from_dotlist([override])
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or first_line(error)
        raise ConfigError(f"override {override!r}: the value is not valid YAML: "
                          f"{problem}") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"override {override!r}: {_omegaconf_message(error)}") from None


def _list_index(cfg: DictConfig, key: str) -> bool:
    """Whether the dotted ``key`` goes into one of ``cfg``'s lists by index
    (``hooks.0.momentum``); raises ConfigError for an index that is not one of the list's."""
    parts = key.split(".")
    for depth in range(1, len(parts)):
        node = OmegaConf.select(cfg, ".".join(parts[:depth]), throw_on_missing=False,
                                throw_on_resolution_failure=False)
        if not isinstance(node, ListConfig):
            continue
        where, index, size = ".".join(parts[:depth]), parts[depth], len(node)
        if not size:
            raise ConfigError(f"{where} is an empty list: it has no item {index!r} to change")
        if not index.isdigit() or int(index) >= size:
            raise ConfigError(f"{where} is a list of {size}: expected an index from 0 to "
                              f"{size - 1} after '{where}.', got {index!r}")
        return True
    return False


def apply_overrides(cfg: DictConfig, overrides: Iterable[str] = (),
                    values: Mapping[str, Any] | None = None) -> DictConfig:
    """``cfg`` with dotlist ``overrides`` merged, then ``values`` (dotted key -> Python value,
    for command-line flags, which win) set. A key may go into a list by index, as MMEngine's
    ``--cfg-options`` allows (``hooks.0.momentum=0.01``: the first hook's momentum)."""
    for override in overrides:
        patch = parse_override(override)
        key = override.partition("=")[0].strip()
        try:
            if _list_index(cfg, key):
                OmegaConf.update(cfg, key, OmegaConf.select(patch, key), merge=True)
                continue
            cfg = OmegaConf.merge(cfg, patch)
        except ConfigError as error:
            raise ConfigError(f"override {override!r}: {error}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(f"override {override!r}: {_omegaconf_message(error)}") from None
        except (TypeError, ValueError) as error:  # e.g. a list over a mapping
            raise ConfigError(f"override {override!r}: {error}") from None
    for key, value in (values or {}).items():
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException as error:
            raise ConfigError(f"{key}: {_omegaconf_message(error)}") from None
    return cfg


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """A plain dict with every interpolation resolved."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None


def _length_from_command_line(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The run's length set on the command line (``schedule.max_iters=N`` or
    ``schedule.max_epochs=N``) replaces the other one where only the file sets it: the command
    line is the later intention. Changes ``cfg``; returns the warning that says so. Both on
    the command line, or both in the file, stay an error (`check_schedule`)."""
    lengths = ("max_epochs", "max_iters")
    given = {key for override in overrides for key in lengths
             if OmegaConf.select(parse_override(override), f"schedule.{key}") is not None}
    if len(given) != 1:
        return []
    (key,) = given
    (other,) = (k for k in lengths if k != key)
    dropped = OmegaConf.select(cfg, f"schedule.{other}")
    if dropped is None:
        return []
    cfg.schedule[other] = None
    unit = "iterations" if key == "max_iters" else "epochs"
    return [f"schedule.{key}={cfg.schedule[key]} on the command line replaces the config "
            f"file's schedule.{other} ({dropped}); schedule.val_interval and "
            f"checkpoint.interval now count {unit}"]


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = (), *,
                values: Mapping[str, Any] | None = None, mode: str = "train",
                on_warning: Callable[[str], None] | None = None) -> DictConfig:
    """Read, override, resolve and validate the config at ``path``.

    ``overrides`` are ``key=value`` strings (``--cfg-options``); ``values`` are set after them
    (command-line flags). The files the config's ``_base_`` names are merged under it
    first, so interpolations resolve across them. ``name`` defaults to the stem of ``path``
    (not a base's). ``mode`` 'test' needs data.test instead of data.train. Warnings go to
    ``on_warning`` (default: the 'trainrun' logger). Raises ConfigError with one line naming
    the key.
    """
    overrides = list(overrides)
    cfg = apply_overrides(read_config(path), overrides, values)
    try:
        unnamed = cfg.get("name", None) is None
    except OmegaConfBaseException:  # an interpolation that does not resolve: resolve() says so
        unnamed = False
    if unnamed:
        cfg["name"] = Path(path).stem
    replaced = _length_from_command_line(cfg, overrides)
    checked, warnings = check(resolve(cfg), mode)
    warnings = [*replaced, *warnings]
    for warning in warnings:
        (on_warning or log.warning)(warning)
    return OmegaConf.create(checked)


# How a run's processes are started and where it starts from: not the run itself (a job
# begun under torchrun may go on under srun).
LAUNCH_KEYS = ("launcher", "backend", "dist_timeout", "resume", "load_from", "work_dir")
# What a resumed run may change without --force: those, how long it trains and which signals
# stop it.
# (logging.step_metrics and logging.window change what is logged, not what is trained; a run
# from before a key existed logged as its default does)
RESUME_MAY_CHANGE = ("schedule.max_epochs", "schedule.max_iters", "schedule.val_begin",
                     "preemption.signals",
                     "logging.step_metrics", "logging.window", *LAUNCH_KEYS)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _empty(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any],
                   may_change: Iterable[str] = RESUME_MAY_CHANGE) -> list[str]:
    """``key: saved -> now`` for every key whose value differs between a run's saved config
    and the config resuming it, but for the keys in ``may_change``. A key the saved config
    lacks whose value now is empty (null, false, [] or {}) is no change: it is a key added to
    trainrun since that run began (``hooks``, ``compile``), at the default that does what the
    run did without it."""
    may_change = set(may_change)
    old, new = _flat(_to_plain(saved)), _flat(_to_plain(now))
    unset = object()

    def shown(value: Any) -> str:
        return "unset" if value is unset else show(value)

    changes = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, unset), new.get(key, unset)
        if before is unset and _empty(after):
            continue
        if key not in may_change and before != after:
            changes.append(f"{key}: {shown(before)} -> {shown(after)}")
    return changes


def saved_config_changes(config_file: Path, now: Mapping[str, Any],
                         may_change: Iterable[str] = RESUME_MAY_CHANGE) -> list[str]:
    """`config_changes` from a run's saved ``config.yaml`` to ``now``. Raises ConfigError
    when the file cannot be read."""
    try:
        saved = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"resume: cannot read {config_file}: {error}") from None
    return config_changes(saved if isinstance(saved, dict) else {}, now, may_change)


def strategy_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The chosen strategy's options from a validated config, as plain values."""
    strategy = _to_plain(cfg["strategy"])
    options = STRATEGIES[strategy["type"]].OPTIONS
    return {k: v for k, v in strategy.items() if k in options}


def dataset_kwargs(section: Mapping[str, Any]) -> dict[str, Any]:
    """A data section without type, loader options and metrics: the data set's arguments."""
    return {k: v for k, v in _to_plain(section).items()
            if k not in ("type", "metrics", *LOADER_OPTIONS)}
