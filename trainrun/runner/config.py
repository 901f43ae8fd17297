"""The run's config: YAML through OmegaConf, dotlist overrides, interpolation, validation.

`load_config` reads the file with OmegaConf's safe YAML loader (no tag builds a Python
object), merges ``key=value`` overrides, resolves interpolations such as ``${name}`` and then
checks every section against the tables below, filling defaults. Every error is one line that
names the dotted key, the bad value and what was expected. Interpolations see only the keys
written in the file or the overrides: defaults are filled after resolution.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.optim import Optimizer

from trainrun.dist import launch
from trainrun.dist.text import closest, is_int, is_number, show
from trainrun.dist.timeouts import DEFAULT_TIMEOUT
from trainrun.runner.optim import PRECISIONS
from trainrun.runner.preemption import STOP_SIGNALS, signal_number
from trainrun.runner.scheduler import check_scheduler, check_total_iters
from trainrun.wrappers import STRATEGIES

log = logging.getLogger("trainrun")

LAUNCHERS = ("none", *launch.LAUNCHERS)  # none: one plain process, nothing to join
LOG_BACKENDS = ("console", "jsonl", "tensorboard")
# DataLoader options of a data section; the rest (but `type` and `metrics`) goes to the data set
LOADER_KEYS = ("batch_size", "num_workers", "shuffle", "drop_last", "pin_memory",
               "persistent_workers")
# optim keys that are the optimiser wrapper's, not the optimiser's
WRAPPER_KEYS = ("clip_grad", "accumulate", "per_module")
SEED_LIMIT = 2**31
# The defaults the schema below fills in; a Runner built from objects, without a config, falls
# back to the same ones (runner.py, builder.py and checkpoint.py read them here).
DEFAULT_SEED = 42
DEFAULT_MAX_EPOCHS = 10
DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_KEEP = 3  # checkpoints kept
DEFAULT_DIST_TIMEOUT = int(DEFAULT_TIMEOUT.total_seconds())  # seconds: dist's (30 min)
# Names people write for a known key; used for "did you mean" when difflib finds nothing.
ALIASES = {
    "learning_rate": "lr", "base_lr": "lr", "wd": "weight_decay", "grad_clip": "clip_grad",
    "clip_grad_norm": "clip_grad", "accumulation_steps": "accumulate",
    "gradient_accumulation_steps": "accumulate", "accumulate_grad_batches": "accumulate",
    "epochs": "max_epochs", "iters": "max_iters", "max_steps": "max_iters",
    "optimizer": "optim", "lr_scheduler": "scheduler", "param_scheduler": "scheduler",
    "amp": "precision", "mixed_precision": "precision", "checkpoint_interval": "interval",
    "log_interval": "interval", "workers": "num_workers", "bs": "batch_size",
}
REQUIRED = object()  # a key without a default
OPTIONAL = object()  # a key without a default that stays absent when not given

Check = Callable[[str, Any], Any]  # (dotted key, value) -> the value, normalised; or raise
Fields = dict[str, tuple[Any, Check]]  # key -> (default or REQUIRED, check)


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the key."""


# ---------------------------------------------------------------- messages

def bad_value(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key}: got {show(value)}, expected {expected}")


def join(key: str, name: Any) -> str:
    return f"{key}.{name}" if key else str(name)


def unknown_key(key: str, name: Any, known: Iterable[str]) -> ConfigError:
    known = list(known)
    hint = closest(str(name), known, ALIASES)
    tail = (f"did you mean '{join(key, hint)}'?" if hint
            else f"expected one of {', '.join(known)}" if known else "it takes no options")
    return ConfigError(f"unknown key '{join(key, name)}'; {tail}")


# ---------------------------------------------------------------- value checks

def _expected(check: Check) -> str:
    return getattr(check, "expected", "a valid value")


def expects(expected: str, check: Check) -> Check:
    """``check`` described as ``expected`` in messages about a missing key."""
    check.expected = expected  # type: ignore[attr-defined]
    return check


def rule(expected: str, test: Callable[[Any], bool]) -> Check:
    """A check that passes values for which ``test`` holds."""
    def check(key: str, value: Any) -> Any:
        if not test(value):
            raise bad_value(key, value, expected)
        return value
    return expects(expected, check)


def integer(minimum: int, maximum: int | None = None) -> Check:
    if maximum is None:
        return rule(f"an int >= {minimum}", lambda v: is_int(v) and v >= minimum)
    return rule(f"an int in [{minimum}, {maximum})",
                lambda v: is_int(v) and minimum <= v < maximum)


def number(*, above: float | None = None, at_least: float | None = None) -> Check:
    if above is not None:
        return rule(f"a number > {above:g}", lambda v: is_number(v) and v > above)
    return rule(f"a number >= {at_least:g}", lambda v: is_number(v) and v >= at_least)


BOOL = rule("true or false", lambda v: isinstance(v, bool))
TEXT = rule("a non-empty string", lambda v: isinstance(v, str) and v.strip() != "")


def choice(*options: str) -> Check:
    """One of ``options``; a near miss gets a suggestion."""
    expected = f"one of {', '.join(options)}"

    def check(key: str, value: Any) -> Any:
        if isinstance(value, str) and value in options:
            return value
        hint = closest(value, options, ALIASES) if isinstance(value, str) else None
        message = f"{key}: got {show(value)}, expected {expected}"
        raise ConfigError(message + (f"; did you mean {hint!r}?" if hint else ""))
    return expects(expected, check)


def nullable(check: Check) -> Check:
    def nullable_check(key: str, value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(key, value)
        except ConfigError as error:
            if not str(error).startswith(f"{key}: got "):
                raise  # about a key inside this one
            raise bad_value(key, value, f"null or {_expected(check)}") from None
    return expects(f"null or {_expected(check)}", nullable_check)


def names(item: Check) -> Check:
    """A list whose every item passes ``item`` (named by index on error); duplicates dropped."""
    expected = f"a list of {_expected(item)}"

    def check(key: str, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise bad_value(key, value, expected)
        checked = [item(f"{key}[{i}]", v) for i, v in enumerate(value)]
        return list(dict.fromkeys(checked))
    return expects(expected, check)


def existing_path(key: str, value: Any) -> str:
    if not isinstance(value, str) or not os.path.exists(value):
        raise bad_value(key, value, "an existing file or directory")
    return value


existing_path.expected = "an existing file or directory"  # type: ignore[attr-defined]


# ---------------------------------------------------------------- sections

def fields(key: str, value: Any, table: Fields, *, open_: bool = False) -> dict[str, Any]:
    """Check the mapping ``value`` against ``table``, filling defaults (null is {}).

    Known keys come first, in the table's order; an open section keeps its other keys as they
    are, a closed one rejects them with a suggestion.
    """
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise bad_value(key or "the config", value, "a mapping")
    if not open_:
        for name in value:
            if name not in table:
                raise unknown_key(key, name, table)
    out: dict[str, Any] = {}
    for name, (default, check) in table.items():
        if name in value:
            out[name] = check(join(key, name), value[name])
        elif default is REQUIRED:
            raise ConfigError(f"{join(key, name)}: missing, expected {_expected(check)}")
        elif default is not OPTIONAL:
            out[name] = check(join(key, name), default)
    out.update((name, v) for name, v in value.items() if name not in table)
    return out


def section(table: Fields, *, open_: bool = False) -> Check:
    return expects("a mapping", partial(fields, table=table, open_=open_))


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


TYPE_NAME = rule("a non-empty string (a registered name or a dotted import path)",
                 lambda v: isinstance(v, str) and v.strip() != "")
MODEL = expects("a mapping with a 'type'", section({"type": (REQUIRED, TYPE_NAME)}, open_=True))


def loader_table(split: str) -> Fields:
    table: Fields = {
        "type": (REQUIRED, TYPE_NAME),
        "batch_size": (DEFAULT_BATCH_SIZE, integer(1)),
        "num_workers": (0, integer(0)),
        "shuffle": (split == "train", BOOL),
        "drop_last": (False, BOOL),
        "pin_memory": (False, BOOL),
        "persistent_workers": (False, BOOL),
    }
    if split != "train":
        table["metrics"] = (None, nullable(names(TEXT)))
    return table


def check_loader(key: str, value: Any, split: str, warnings: list[str]) -> dict[str, Any]:
    """A data section: the data set's type, its DataLoader options and any data set kwargs."""
    if split == "train" and isinstance(value, Mapping) and "metrics" in value:
        raise bad_value(f"{key}.metrics", value["metrics"],
                        "no metrics on the train section (they belong under data.val or data.test)")
    out = fields(key, value, loader_table(split), open_=True)
    if out["persistent_workers"] and out["num_workers"] == 0:
        raise bad_value(f"{key}.persistent_workers", True, f"false when {key}.num_workers is 0")
    for name in out:
        if name not in loader_table(split):
            hint = difflib.get_close_matches(str(name), LOADER_KEYS, n=1, cutoff=0.8)
            if hint:
                warnings.append(f"{join(key, name)} is passed to the data set; "
                                f"did you mean '{join(key, hint[0])}'?")
    return out


def check_data(key: str, value: Any, mode: str, warnings: list[str]) -> dict[str, Any]:
    def split(name: str) -> tuple[Any, Check]:
        check = expects("a data section with a 'type'",
                        partial(check_loader, split=name, warnings=warnings))
        needed = (mode == "train" and name == "train") or (mode == "test" and name == "test")
        return (REQUIRED, check) if needed else (None, nullable(check))

    return fields(key, value, {name: split(name) for name in ("train", "val", "test")})


# ---------------------------------------------------------------- optimiser

def optimizer_names() -> list[str]:
    return sorted(name for name, cls in vars(torch.optim).items()
                  if isinstance(cls, type) and issubclass(cls, Optimizer) and cls is not Optimizer)


def optimizer_arguments(name: str) -> set[str] | None:
    """The keyword arguments ``torch.optim.<name>`` takes besides params (None: any)."""
    parameters = inspect.signature(getattr(torch.optim, name)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return {p for p in parameters if p not in ("self", "params")}


CLIP_GRAD = expects("null, a number > 0 or {max_norm: ..., norm_type: ...}", section({
    "max_norm": (REQUIRED, number(above=0)),
    "norm_type": (2.0, rule("a number", is_number)),
    "error_if_nonfinite": (OPTIONAL, BOOL),
    "foreach": (OPTIONAL, nullable(BOOL)),
}))


def check_clip_grad(key: str, value: Any) -> dict[str, Any] | None:
    """null, or {max_norm, norm_type, ...}; a plain number is the max norm."""
    if value is None:
        return None
    if is_number(value):
        value = {"max_norm": value}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, _expected(CLIP_GRAD))
    return CLIP_GRAD(key, value)


def optim_table(kind: str, arguments: set[str] | None) -> Fields:
    """The keys every optim section has; weight_decay only where the optimiser takes it."""
    table: Fields = {"type": ("AdamW", lambda _, v: kind), "lr": (1e-3, number(above=0))}
    if arguments is None or "weight_decay" in arguments:
        table["weight_decay"] = (0.0, number(at_least=0))
    table.update(clip_grad=(None, check_clip_grad), accumulate=(1, integer(1)))
    return table


def check_optim(key: str, value: Any, where: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The optimiser section (but per_module): a ``torch.optim`` class, its arguments (checked
    against its signature) and the wrapper's keys.

    ``where`` names each key in messages (per-module overrides name theirs differently).
    """
    where = where or partial(join, key)
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, "a mapping with the optimiser's type and arguments")
    kind = choice(*optimizer_names())(where("type"), value.get("type", "AdamW"))
    arguments = optimizer_arguments(kind)
    table = optim_table(kind, arguments)
    extra = {k: v for k, v in value.items() if k not in table and k != "per_module"}
    for name in extra:
        if arguments is not None and name not in arguments:
            hint = closest(str(name), [*table, "per_module", *sorted(arguments)], ALIASES)
            sibling = join(where(name).rpartition(".")[0], hint)
            raise ConfigError(f"unknown key '{where(name)}'; " + (
                f"did you mean '{sibling}'?" if hint
                else f"{kind} takes {', '.join(sorted(arguments))}"))
    out = {name: check(where(name), value.get(name, default))
           for name, (default, check) in table.items()}
    return {**out, **extra}


def check_per_module(key: str, optim: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """``optim.per_module``: {submodule: {overrides of the optim keys}}, each checked merged
    with the shared keys; the result keeps the overrides only."""
    value = optim.get("per_module")
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise bad_value(key, value, "null or a mapping of submodule names to option overrides")
    optim_key = key.rpartition(".")[0]
    shared = {k: v for k, v in optim.items() if k != "per_module"}
    out: dict[str, dict[str, Any]] = {}
    for name, overrides in value.items():
        prefix = join(key, name)
        overrides = {} if overrides is None else overrides
        if not isinstance(name, str) or not name:
            raise bad_value(prefix, name, "a submodule name")
        if not isinstance(overrides, Mapping):
            raise bad_value(prefix, overrides, "null or a mapping of optim options")
        if "per_module" in overrides:
            raise unknown_key(prefix, "per_module", shared)

        def where(option: str, _prefix: str = prefix, _own: Mapping = overrides) -> str:
            return join(_prefix if option in _own else optim_key, option)

        merged = check_optim(prefix, {**shared, **overrides}, where)
        out[name] = {k: merged[k] for k in overrides}
    return out


def check_optim_section(key: str, value: Any) -> dict[str, Any]:
    out = check_optim(key, value)
    out["per_module"] = check_per_module(join(key, "per_module"),
                                         value if isinstance(value, Mapping) else {})
    return out


# ---------------------------------------------------------------- other sections

def check_schedule(key: str, value: Any) -> dict[str, Any]:
    out = fields(key, value, {
        "max_epochs": (None, nullable(integer(1))),
        "max_iters": (None, nullable(integer(1))),
        "val_interval": (1, integer(1)),
    })
    if out["max_epochs"] is not None and out["max_iters"] is not None:
        raise ConfigError(f"{key}: got both max_epochs ({out['max_epochs']}) and max_iters "
                          f"({out['max_iters']}), expected exactly one")
    if out["max_epochs"] is None and out["max_iters"] is None:
        out["max_epochs"] = DEFAULT_MAX_EPOCHS
    return out


def check_logging(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    out = fields(key, value, {
        "interval": (10, integer(1)),
        "backends": (["console", "jsonl"], names(choice(*LOG_BACKENDS))),
    })
    if "tensorboard" in out["backends"] and importlib.util.find_spec("tensorboard") is None:
        out["backends"].remove("tensorboard")
        warnings.append(f"{key}.backends: tensorboard is not installed (pip install "
                        f"tensorboard); its logs are skipped")
    return out


def best_rule_for(metric: str) -> str:
    """Whether a higher value of ``metric`` is better ('greater') or a lower one ('less': a
    loss, however it is spelt), where the config does not say."""
    return "less" if "loss" in metric.lower() else "greater"


def check_checkpoint(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    out = fields(key, value, {
        "interval": (1, integer(0)),
        "max_keep": (DEFAULT_MAX_KEEP, rule("an int >= 1, or -1 to keep all",
                             lambda v: is_int(v) and (v >= 1 or v == -1))),
        "save_last": (True, BOOL),
        "save_best": (None, nullable(TEXT)),
        "best_rule": (None, nullable(choice("greater", "less"))),
        "async": (False, BOOL),
    })
    if out["save_best"] is None:
        if out["best_rule"] is not None:
            warnings.append(f"{key}.best_rule is ignored without {key}.save_best")
            out["best_rule"] = None
    elif out["best_rule"] is None:
        out["best_rule"] = best_rule_for(out["save_best"])
    return out


def stop_signal(key: str, value: Any) -> str:
    """A signal name ('SIGTERM', 'TERM', 'usr1') that can be caught, as 'SIGTERM'."""
    if not isinstance(value, str):
        raise bad_value(key, value, "a signal name such as SIGTERM or SIGUSR1")
    try:
        return signal_number(value).name
    except ValueError as error:
        raise bad_value(key, value, f"a signal that can be caught ({error})") from None


stop_signal.expected = "signal names such as SIGTERM or SIGUSR1"  # type: ignore[attr-defined]


def check_resume(key: str, value: Any) -> bool | str:
    if value is None or isinstance(value, bool):
        return bool(value)
    if not isinstance(value, str):
        raise bad_value(key, value, "false, true or a checkpoint path")
    return existing_path(key, value)


def check_scheduler_section(key: str, value: Any) -> dict[str, Any] | None:
    try:
        return check_scheduler(value, key)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def top_level(mode: str, warnings: list[str]) -> Fields:
    """The table of the whole config (``work_dir``'s default is filled from ``name``)."""
    return {
        "name": (REQUIRED, TEXT),
        "work_dir": (None, nullable(TEXT)),
        "launcher": ("none", choice(*LAUNCHERS)),
        "backend": ("auto", choice(*launch.BACKENDS)),
        "dist_timeout": (DEFAULT_DIST_TIMEOUT, number(above=0)),
        "strategy": (None, partial(check_strategy, warnings=warnings)),
        "model": (REQUIRED, MODEL),
        "data": (REQUIRED, partial(check_data, mode=mode, warnings=warnings)),
        "optim": (None, check_optim_section),
        "scheduler": (None, check_scheduler_section),
        "precision": ("fp32", choice(*PRECISIONS)),
        "schedule": (None, check_schedule),
        "randomness": (None, section({
            "seed": (DEFAULT_SEED, nullable(integer(0, SEED_LIMIT))),
            "deterministic": (False, BOOL),
            "diff_rank_seed": (False, BOOL),
        })),
        "logging": (None, partial(check_logging, warnings=warnings)),
        "checkpoint": (None, partial(check_checkpoint, warnings=warnings)),
        "preemption": (None, section({
            "signals": (list(STOP_SIGNALS), names(stop_signal)),
        })),
        "resume": (False, check_resume),
        "load_from": (None, nullable(existing_path)),
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
    if out["schedule"]["max_iters"] is not None:
        try:
            check_total_iters(out["scheduler"], out["schedule"]["max_iters"],
                              total_name="schedule.max_iters")
        except ValueError as error:
            raise ConfigError(str(error)) from None
    try:
        STRATEGIES[out["strategy"]["type"]].check_config(out)
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
    message = str(getattr(error, "msg", None) or error).strip().splitlines()[0]
    key = getattr(error, "full_key", None)
    return f"{key}: {message}" if key else message


def read_yaml(path: str | os.PathLike[str]) -> DictConfig:
    """The file's mapping, with OmegaConf's safe loader: tags that build objects are refused."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {str(path)!r}")
    try:
        cfg = OmegaConf.load(path)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = (error.problem or error.context or "invalid YAML").replace("\n", " ")
        if "constructor for the tag" in problem:
            problem += " (tags that build Python objects are not allowed)"
        raise ConfigError(f"{where}: {problem}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: {str(error).splitlines()[0]}") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: {_omegaconf_message(error)}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the config: {error}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: got a {type(cfg).__name__} at the top level, "
                          f"expected a mapping of keys")
    return cfg


def parse_override(override: str) -> DictConfig:
    """One ``key.sub=value`` override (the value is YAML) as a config to merge."""
    key, equals, _ = str(override).partition("=")
    parts = key.strip().split(".")
    if not equals or not all(part.strip() for part in parts):
        raise ConfigError(f"override {override!r}: expected key=value with a dotted key, "
                          f"e.g. optim.lr=0.01")
    try:
        return OmegaConf.from_dotlist([override])
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"override {override!r}: the value is not valid YAML: "
                          f"{problem}") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"override {override!r}: {_omegaconf_message(error)}") from None


def apply_overrides(cfg: DictConfig, overrides: Iterable[str] = (),
                    values: Mapping[str, Any] | None = None) -> DictConfig:
    """``cfg`` with dotlist ``overrides`` merged, then ``values`` (dotted key -> Python value,
    for command-line flags, which win) set."""
    for override in overrides:
        patch = parse_override(override)
        try:
            cfg = OmegaConf.merge(cfg, patch)
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
    return [f"schedule.{key}={cfg.schedule[key]} on the command line replaces the config "
            f"file's schedule.{other} ({dropped})"]


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = (), *,
                values: Mapping[str, Any] | None = None, mode: str = "train",
                on_warning: Callable[[str], None] | None = None) -> DictConfig:
    """Read, override, resolve and validate the config at ``path``.

    ``overrides`` are ``key=value`` strings (``--cfg-options``); ``values`` are set after them
    (command-line flags). ``name`` defaults to the file's stem. ``mode`` 'test' needs data.test
    instead of data.train. Warnings go to ``on_warning`` (default: the 'trainrun' logger).
    Raises ConfigError with one line naming the key.
    """
    overrides = list(overrides)
    cfg = apply_overrides(read_yaml(path), overrides, values)
    if cfg.get("name", None) is None:
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
RESUME_MAY_CHANGE = ("schedule.max_epochs", "schedule.max_iters", "preemption.signals",
                     *LAUNCH_KEYS)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any],
                   may_change: Iterable[str] = RESUME_MAY_CHANGE) -> list[str]:
    """``key: saved -> now`` for every key whose value differs between a run's saved config
    and the config resuming it, but for the keys in ``may_change``."""
    may_change = set(may_change)
    old, new = _flat(_to_plain(saved)), _flat(_to_plain(now))
    unset = object()

    def shown(value: Any) -> str:
        return "unset" if value is unset else show(value)

    changes = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, unset), new.get(key, unset)
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
            if k not in ("type", "metrics", *LOADER_KEYS)}
