"""The ``optim`` section of a config: the optimiser's type and arguments (checked against
its signature), the wrapper's ``clip_grad``, ``accumulate`` and ``per_module``, and
``paramwise`` (checked by ``trainrun.runner.optim.param_groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from trainrun.messages import closest, is_number
from trainrun.runner.optim.factory import optimizer_arguments, optimizer_names
from trainrun.runner.optim.param_groups import check_paramwise
from trainrun.runner.schema import (
    ALIASES,
    OPTIONAL,
    REQUIRED,
    ConfigError,
    Fields,
    bad_value,
    check_bool,
    choice,
    expects,
    integer,
    join,
    nullable,
    number,
    rule,
    section,
    unknown_key,
)

ONE_GROUP = ("LBFGS",)  # optimisers that refuse parameter groups


CLIP_GRAD_KEYS = {
    "max_norm": (REQUIRED, number(above=0), "the largest total gradient norm kept"),
    "norm_type": (2.0, rule("a number", is_number), "which norm (2: Euclidean; inf: max)"),
    "error_if_nonfinite": (OPTIONAL, check_bool,
                           "raise when the norm is nan or inf (torch's clip_grad_norm_)"),
    "foreach": (OPTIONAL, nullable(check_bool),
                "torch's clip_grad_norm_ (clip_grad_value_) foreach option"),
}
# the other form: each gradient value clipped, as torch's clip_grad_value_ does
CLIP_VALUE_KEYS = {
    "clip_value": (REQUIRED, number(above=0),
                   "instead of max_norm: clip each gradient value to [-clip_value, clip_value] "
                   "(torch's clip_grad_value_; not with strategy deepspeed)"),
    "foreach": CLIP_GRAD_KEYS["foreach"],
}
CLIP_GRAD_EXPECTED = ("null, a number > 0, {max_norm: ..., norm_type: ...} or "
                      "{clip_value: ...}")
check_clip_norm_options = section(CLIP_GRAD_KEYS)
check_clip_value_options = section(CLIP_VALUE_KEYS)


def check_clip_grad(key: str, value: Any) -> dict[str, Any] | None:
    """null, {max_norm, norm_type, ...} (a plain number is the max norm) or {clip_value, ...}:
    clip the total norm, or each value."""
    if value is None:
        return None
    if is_number(value):
        value = {"max_norm": value}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, CLIP_GRAD_EXPECTED)
    if "clip_value" in value and "max_norm" in value:
        raise bad_value(key, dict(value), "max_norm (clip the norm) or clip_value (clip each "
                                          "value), not both")
    if "clip_value" in value:
        return check_clip_value_options(key, value)
    if "max_norm" not in value:  # neither form named: a misspelt key may mean either
        known = {**CLIP_GRAD_KEYS, **CLIP_VALUE_KEYS}
        for name in value:
            if name not in known:
                raise unknown_key(key, name, known)
    return check_clip_norm_options(key, value)


check_clip_grad.expected = CLIP_GRAD_EXPECTED  # type: ignore[attr-defined]


def optim_table(kind: str, arguments: set[str] | None) -> Fields:
    """The keys every optim section has; weight_decay only where the optimiser takes it."""
    table: Fields = {
        "type": ("AdamW", expects(f"one of {', '.join(optimizer_names())}", lambda _, v: kind),
                 "a torch.optim optimiser's name"),
        "lr": (1e-3, number(above=0), "the base learning rate"),
    }
    has_decay = arguments is None or "weight_decay" in arguments
    if has_decay:
        table["weight_decay"] = (0.0, number(at_least=0), "the base weight decay")
    paramwise = expects("null or a mapping", partial(check_paramwise, has_decay=has_decay))
    if kind in ONE_GROUP:
        paramwise = rule(f"null: {kind} takes one parameter group", lambda v: v is None)
    # paramwise stays absent unless given, so that the saved config of a run from before it
    # existed still matches on resume
    table.update(
        clip_grad=(None, check_clip_grad,
                   "clip the gradients before each step: null (no clipping), the max total "
                   "norm, {max_norm, norm_type} or each value's bound {clip_value}"),
        accumulate=(1, integer(1),
                    "accumulate the gradients of this many iterations before each step"),
        paramwise=(OPTIONAL, paramwise,
                   "learning rate and weight decay per parameter group (see "
                   "optim.paramwise)"))
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
           for name, (default, check, *_) in table.items()
           if name in value or default is not OPTIONAL}
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

        def where(option: str, _prefix: str = prefix, _overridden: Mapping = overrides) -> str:
            return join(_prefix if option in _overridden else optim_key, option)

        merged = check_optim(prefix, {**shared, **overrides}, where)
        out[name] = {k: merged[k] for k in overrides}
    return out


def check_optim_section(key: str, value: Any) -> dict[str, Any]:
    out = check_optim(key, value)
    out["per_module"] = check_per_module(join(key, "per_module"),
                                         value if isinstance(value, Mapping) else {})
    return out
