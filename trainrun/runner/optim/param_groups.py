"""Parameter groups from ``optim.paramwise``: per-parameter multipliers of the learning rate
and the weight decay, with MMEngine's names.

A parameter gets the multipliers of the first rule that applies to it:

1. ``custom_keys``: a key is a part of the parameter's full name (``blocks.0.attn``); the
   longest key found in the name wins (equal lengths: the alphabetically first). Its
   ``lr_mult`` and ``decay_mult`` (1 where not given) are then all that applies.
2. Otherwise a parameter of a normalisation layer (BatchNorm, GroupNorm, LayerNorm,
   InstanceNorm, RMSNorm and their subclasses) gets ``norm_decay_mult``; a parameter named
   ``bias`` of any other layer gets ``bias_lr_mult`` and ``bias_decay_mult`` (a normalisation
   layer's bias gets ``bias_decay_mult`` only when ``norm_decay_mult`` is not set).

Parameters that end with the same learning rate and weight decay share one group, so the
optimiser holds few groups. Groups come in a fixed order, the same on every rank and in every
run of the config (the one holding the base rate and decay first, the others in the order of
their first parameter), which is what lets a checkpoint's optimiser state load into them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from trainrun.runner.schema import (
    ConfigError,
    Fields,
    bad_value,
    expects,
    fields,
    join,
    nullable,
    number,
    section,
)

# normalisation layers, by their torch base classes (subclasses count too)
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    cls for cls in (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                    nn.GroupNorm, nn.LayerNorm, getattr(nn, "RMSNorm", None),
                    nn.LocalResponseNorm) if cls is not None)

check_multiplier = number(at_least=0)
CUSTOM_KEY_OPTIONS = {
    "lr_mult": (1.0, check_multiplier, "the matched parameters' learning rate, times optim.lr"),
    "decay_mult": (1.0, check_multiplier, "their weight decay, times optim.weight_decay"),
}
check_custom_key_options = section(CUSTOM_KEY_OPTIONS)
DECAY_MULTS = ("bias_decay_mult", "norm_decay_mult")


def check_custom_keys(key: str, value: Any) -> dict[str, dict[str, float]]:
    """{part of a parameter name: {lr_mult, decay_mult}}; null is {}."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, "a mapping of parameter names (or parts of them) to "
                        "{lr_mult, decay_mult}")
    out = {}
    for name, options in value.items():
        if not isinstance(name, str) or not name.strip():
            raise bad_value(key, name, "parameter names (or parts of them) as non-empty strings")
        out[name] = check_custom_key_options(join(key, name), {} if options is None else options)
    return out


check_custom_keys.expected = "a mapping of names to {lr_mult, decay_mult}"  # type: ignore

PARAMWISE: Fields = {
    "bias_lr_mult": (None, nullable(check_multiplier),
                     "learning-rate multiplier of parameters named bias (not norm layers')"),
    "bias_decay_mult": (None, nullable(check_multiplier),
                        "weight-decay multiplier of those biases"),
    "norm_decay_mult": (None, nullable(check_multiplier),
                        "weight-decay multiplier of normalisation layers' parameters"),
    "custom_keys": ({}, check_custom_keys,
                    "{part of a parameter's name: {lr_mult, decay_mult}}; the longest "
                    "matching part wins"),
}


def check_paramwise(key: str, value: Any, has_decay: bool = True) -> dict[str, Any] | None:
    """``optim.paramwise``: null (one group, as without it) or the table above.
    ``has_decay``: whether the optimiser takes weight_decay (else decay multipliers are refused)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_value(key, value, "null or a mapping of bias_lr_mult, bias_decay_mult, "
                        "norm_decay_mult and custom_keys")
    out = fields(key, value, PARAMWISE)
    if not has_decay:
        given = [join(key, m) for m in DECAY_MULTS if out[m] is not None] + [
            join(join(join(key, "custom_keys"), name), "decay_mult")
            for name, options in (value.get("custom_keys") or {}).items()
            if isinstance(options, Mapping) and "decay_mult" in options]
        if given:
            raise ConfigError(f"{given[0]}: the optimiser takes no weight_decay, so there is "
                              f"no decay to multiply; remove it")
    return out


expects("null or a mapping", check_paramwise)


# ---------------------------------------------------------------- grouping

@dataclass
class Group:
    """Parameters sharing one learning rate and weight decay; ``name`` says which rules made
    it ('default', 'bias', 'norm', a custom key in quotes; joined with ' + ')."""

    name: str
    lr: float
    weight_decay: float | None
    params: list[nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def as_optimizer_group(self) -> dict[str, Any]:
        """The dict a torch optimiser takes (``name`` travels in its state_dict)."""
        group = {"params": self.params, "lr": self.lr, "name": self.name}
        if self.weight_decay is not None:
            group["weight_decay"] = self.weight_decay
        return group


def named_parameters_with_layers(module: nn.Module, prefix: str = ""
                                 ) -> Iterator[tuple[str, nn.Parameter, nn.Module]]:
    """Every parameter once (shared ones under their first name), with its full name and the
    layer holding it, in ``module.named_parameters()``'s order."""
    seen: set[int] = set()
    for layer_name, layer in module.named_modules(prefix=prefix.rstrip(".")):
        for name, param in layer.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield join(layer_name, name), param, layer


def sorted_keys(custom_keys: Mapping[str, Any]) -> list[str]:
    """The custom keys in the order they are tried: longest first, then alphabetical."""
    return sorted(sorted(custom_keys), key=len, reverse=True)


def rule_for(name: str, layer: nn.Module, paramwise: Mapping[str, Any],
             keys: list[str]) -> tuple[str, float, float, str | None]:
    """(rule's label, lr multiplier, decay multiplier, custom key matched) of one parameter."""
    for key in keys:
        if key in name:
            options = paramwise["custom_keys"][key]
            return repr(key), options["lr_mult"], options["decay_mult"], key
    is_norm = isinstance(layer, NORM_LAYERS)
    is_bias = name.rpartition(".")[2] == "bias"
    labels, lr_mult, decay_mult = [], 1.0, 1.0
    if is_bias and not is_norm and paramwise["bias_lr_mult"] is not None:
        lr_mult = paramwise["bias_lr_mult"]
        labels.append("bias")
    if is_norm and paramwise["norm_decay_mult"] is not None:
        decay_mult = paramwise["norm_decay_mult"]
        labels.append("norm")
    elif is_bias and paramwise["bias_decay_mult"] is not None:
        decay_mult = paramwise["bias_decay_mult"]
        labels.append("bias")
    return "+".join(dict.fromkeys(labels)) or "default", lr_mult, decay_mult, None


def param_groups(module: nn.Module, lr: float, weight_decay: float | None,
                 paramwise: Mapping[str, Any], prefix: str = "") -> tuple[list[Group], list[str]]:
    """The groups of ``module``'s parameters (named ``prefix`` + their name in it) under the
    checked ``paramwise`` section, and the custom keys that matched no parameter."""
    keys = sorted_keys(paramwise["custom_keys"])
    matched: set[str] = set()
    groups: dict[tuple[float, float | None], Group] = {}
    labels: dict[tuple[float, float | None], list[str]] = {}
    for name, param, layer in named_parameters_with_layers(module, prefix):
        label, lr_mult, decay_mult, key = rule_for(name, layer, paramwise, keys)
        if key is not None:
            matched.add(key)
        rates = (lr * lr_mult, None if weight_decay is None else weight_decay * decay_mult)
        group = groups.setdefault(rates, Group("", *rates))
        group.params.append(param)
        group.names.append(name)
        labels.setdefault(rates, [])
        if label not in labels[rates]:
            labels[rates].append(label)
    for rates, group in groups.items():
        group.name = " + ".join(labels[rates])
    base = (lr, weight_decay)
    ordered = ([groups[base]] if base in groups else []) + [
        g for rates, g in groups.items() if rates != base]
    return ordered, [key for key in paramwise["custom_keys"] if key not in matched]


def describe_groups(optimizer: Any, scope: str = "") -> list[str]:
    """One line per parameter group of a torch ``optimizer``: the rules that made it, its
    rates and its size (the plan and the run's log show these); ``scope``: the submodule of
    one of several optimisers."""
    lines = []
    for group in optimizer.param_groups:
        decay = group.get("weight_decay")
        rates = f"lr {group['lr']:.6g}" + ("" if decay is None else f", weight_decay {decay:.6g}")
        tensors = len(group["params"])
        elements = sum(p.numel() for p in group["params"])
        lines.append(f"{scope + ': ' if scope else ''}{group.get('name', 'all parameters')}: "
                     f"{rates}; {tensors} tensor{'s' if tensors != 1 else ''}, "
                     f"{elements:,} elements")
    return lines


def unmatched_warning(where: str, key: str, scope: str = "the model") -> str:
    return (f"{join(join(where, 'custom_keys'), key)}: matches no parameter of {scope} "
            f"(a key is a part of a parameter's full name); it changes nothing")


def uses_paramwise(optim: Mapping[str, Any]) -> bool:
    """Whether a checked optim section makes parameter groups (for any of its optimisers)."""
    return optim.get("paramwise") is not None or any(
        (overrides or {}).get("paramwise") is not None
        for overrides in (optim.get("per_module") or {}).values())
