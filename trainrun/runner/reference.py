"""Every config key with its default, what it accepts and what it means.

The docs' config reference is generated from this when the site is built, and it reads the
same tables that check a config (`schema.py` says how one is written), so the two cannot
drift apart: a key added to a table without its one line of meaning fails a test.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import yaml

from trainrun.registry import DATASETS, HOOKS, MODELS, STRATEGIES, Registry
from trainrun.runner.builder import loader_table
from trainrun.runner.config import COMPILE, LAUNCH_KEYS, top_level
from trainrun.runner.hooks.checkpoint import CHECKPOINT
from trainrun.runner.hooks.from_config import ITEM
from trainrun.runner.hooks.guard import GUARD_KEYS, SPIKE
from trainrun.runner.hooks.logger import LOGGING
from trainrun.runner.loops import SCHEDULE
from trainrun.runner.optim.factory import optimizer_arguments
from trainrun.runner.optim.param_groups import CUSTOM_KEY_OPTIONS, PARAMWISE
from trainrun.runner.optim.schedulers import _TYPE as SCHEDULER_TYPE
from trainrun.runner.optim.schedulers import SCHEDULER_OPTIONS
from trainrun.runner.optim.section import CLIP_GRAD_KEYS, CLIP_VALUE_KEYS, optim_table
from trainrun.runner.preemption import PREEMPTION_KEYS
from trainrun.runner.schema import OPTIONAL, REQUIRED, Fields, expected_of
from trainrun.runner.seed import RANDOMNESS_KEYS

SPLITS = ("train", "val", "test")
DEFAULT_OPTIMISER = "AdamW"


@dataclass(frozen=True)
class Entry:
    """One key: ``key`` dotted (``optim.paramwise.bias_lr_mult``), ``default`` as YAML writes
    it (or ``required``, or ``unset``), what it ``accepts`` and what it means."""

    key: str
    default: str
    accepts: str
    meaning: str


@dataclass(frozen=True)
class Section:
    """A table of keys: ``anchor`` names it on the page (``cfg-optim-paramwise``)."""

    anchor: str
    title: str
    about: str
    entries: tuple[Entry, ...]


def shown_default(default: Any) -> str:
    if default is REQUIRED:
        return "required"
    if default is OPTIONAL:
        return "unset"
    return yaml.safe_dump(default, default_flow_style=True, width=1000).strip().removesuffix(
        "\n...").removesuffix("...").strip()


def table_entries(prefix: str, table: Fields) -> tuple[Entry, ...]:
    """A schema table's keys under ``prefix``; a key without its meaning has ``meaning`` ''.
    (A hook's table leaves the meanings to its class docstring's ``Args:``.)"""
    return tuple(Entry(f"{prefix}.{name}" if prefix else name, shown_default(item[0]),
                       expected_of(item[1]), item[2] if len(item) > 2 else "")
                 for name, item in table.items())


def docstring_args(obj: Any) -> dict[str, str]:
    """The ``Args:`` section of ``obj``'s Google-style docstring: name -> its text, joined."""
    doc = inspect.getdoc(obj) or ""
    found: dict[str, str] = {}
    inside, name = False, None
    for line in doc.splitlines():
        if not inside:
            inside = line.strip() == "Args:"
            continue
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^ {4}(\*{0,2}\w+)(?: \(.*?\))?: ?(.*)$", line)
        if match:
            name = match.group(1).lstrip("*")
            found[name] = match.group(2).strip()
        elif name and line.strip():
            found[name] = f"{found[name]} {line.strip()}"
    return found


def signature_entries(prefix: str, target: Any, skip: tuple[str, ...] = ()) -> tuple[Entry, ...]:
    """The keyword arguments of a class (a model, a data set), documented by its docstring."""
    docs = docstring_args(target)
    entries = []
    for name, parameter in inspect.signature(target).parameters.items():
        if name in skip or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = REQUIRED if parameter.default is parameter.empty else parameter.default
        annotation = parameter.annotation
        accepts = "" if annotation is parameter.empty else inspect.formatannotation(annotation)
        entries.append(Entry(f"{prefix}.{name}", shown_default(default), accepts,
                             docs.get(name, "")))
    return tuple(entries)


def anchor(*parts: str) -> str:
    return "cfg-" + "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts)


# ---------------------------------------------------------------- the sections

def top_section() -> Section:
    return Section(anchor("top"), "The top level",
                   "The run's own keys; each other key is a section below. Those that say how "
                   "the processes start and where the run starts from "
                   f"({', '.join(LAUNCH_KEYS)}) may change when a run is resumed.",
                   table_entries("", top_level("train", [])))


# the sections of one table each, with no class or type to choose their keys
PLAIN_SECTIONS = ("compile", "schedule", "randomness", "logging", "checkpoint", "preemption")


def plain_sections() -> list[Section]:
    return [
        Section(anchor("compile"), "compile",
                "`compile: true` compiles with every default below; see the compile page.",
                table_entries("compile", COMPILE)),
        Section(anchor("schedule"), "schedule", "How long the loop trains, and when it "
                "validates.", table_entries("schedule", SCHEDULE)),
        Section(anchor("randomness"), "randomness", "Seeds: rank 0's seed reaches every rank.",
                table_entries("randomness", RANDOMNESS_KEYS)),
        Section(anchor("logging"), "logging", "What is logged, how often, and where.",
                table_entries("logging", LOGGING)),
        Section(anchor("checkpoint"), "checkpoint", "When checkpoints are written and how "
                "many are kept.", table_entries("checkpoint", CHECKPOINT)),
        Section(anchor("preemption"), "preemption", "Which signals stop training at a step "
                "boundary with a checkpoint.", table_entries("preemption", PREEMPTION_KEYS)),
        Section(anchor("guard"), "guard", "What a run that goes wrong numerically makes "
                "training do; see the page on runs that go wrong.",
                table_entries("guard", GUARD_KEYS)),
        Section(anchor("guard", "spike"), "guard.spike", "`spike: {}` watches for spikes "
                "with every default below; `spike: null` (the default) does not.",
                table_entries("guard.spike", SPIKE)),
    ]


def strategy_sections() -> list[Section]:
    names = ", ".join(STRATEGIES)
    sections = [Section(anchor("strategy"), "strategy",
                        "How the model is spread over the ranks. `strategy: fsdp` is short "
                        "for `strategy: {type: fsdp}`. Options of another strategy than the "
                        "chosen one are reported once as ignored.",
                        (Entry("strategy.type", "ddp", f"one of {names}",
                               "the strategy; its options follow"),))]
    for name, cls in STRATEGIES.items():
        meanings = docstring_args(cls)
        entries = tuple(Entry(f"strategy.{option}", shown_default(default),
                              cls.ACCEPTS.get(option, ""), meanings.get(option, ""))
                        for option, default in cls.OPTIONS.items())
        about = (f"`strategy.type: {name}`" + ("" if entries else ": it takes no options")
                 + ".")
        sections.append(Section(anchor("strategy", name), f"strategy: {name}", about, entries))
    return sections


def model_sections() -> list[Section]:
    sections = [Section(anchor("model"), "model",
                        "The model: `type` names its class, every other key is an argument of "
                        "that class.",
                        (Entry("model.type", "required",
                               "a registered name or a dotted import path",
                               "the model's class: a built-in name below, or "
                               "my_module.MyModel (imported from the working directory and "
                               "PYTHONPATH)"),))]
    for name in MODELS:
        try:
            cls = MODELS[name]
        except ValueError:  # its optional extra is not installed here
            continue
        sections.append(Section(anchor("model", name), f"model: {name}",
                                f"`model.type: {name}` ({where(MODELS, name)}).",
                                signature_entries("model", cls)))
    return sections


def where(registry: Registry, name: str) -> str:
    """Where a registered name's class lives, as a dotted path (not importing it)."""
    target = registry.target(name)
    return target.replace(":", ".") if isinstance(target, str) \
        else f"{target.__module__}.{target.__qualname__}"


def data_sections() -> list[Section]:
    split_entries = tuple(
        Entry(f"data.{split}", shown_default(None if split != "train" else REQUIRED),
              "a data section" + (", or several named ones" if split == "val" else ""),
              {"train": "the training data (with `trainrun test`: not needed)",
               "val": "the validation data; several named sets are a mapping of sections",
               "test": "the data `trainrun test` scores"}[split])
        for split in SPLITS)
    sections = [Section(anchor("data"), "data", "The data sections.", split_entries),
                Section(anchor("data", "split"), "data.<split>",
                        "Each of `data.train`, `data.val` and `data.test` (and each named "
                        "validation set, `data.val.<name>`): `type` names the data set, these "
                        "keys go to the DataLoader, every other key is an argument of the "
                        "data set.", split_table_entries())]
    for name in DATASETS:
        cls = DATASETS[name]
        sections.append(Section(anchor("data", name), f"data.<split>: {name}",
                                f"`data.<split>.type: {name}` ({where(DATASETS, name)}).",
                                signature_entries("data.<split>", cls)))
    return sections


def split_table_entries() -> tuple[Entry, ...]:
    """The loader keys of every split in one table; a default that differs by split says so."""
    tables = {split: loader_table(split) for split in SPLITS}
    entries = []
    for name in dict.fromkeys(k for table in tables.values() for k in table):
        having = [split for split in SPLITS if name in tables[split]]
        item = tables[having[0]][name]
        defaults = {split: shown_default(tables[split][name][0]) for split in having}
        default = defaults[having[0]] if len(set(defaults.values())) == 1 else "; ".join(
            f"{split}: {value}" for split, value in defaults.items())
        meaning = item[2] if len(item) > 2 else ""
        if len(having) < len(SPLITS):
            meaning = f"{meaning} ({' and '.join(having)} only)"
        entries.append(Entry(f"data.<split>.{name}", default, expected_of(item[1]), meaning))
    return tuple(entries)


def optim_sections() -> list[Section]:
    arguments = optimizer_arguments(DEFAULT_OPTIMISER) or set()
    table = optim_table(DEFAULT_OPTIMISER, arguments)
    own = table_entries("optim", table) + (Entry(
        "optim.per_module", "null", "null or {submodule: {optim keys}}",
        "one optimiser per submodule (separate_ddp), each with these overrides of the keys "
        "above"),)
    optimiser = getattr(torch.optim, DEFAULT_OPTIMISER)
    extra = tuple(Entry(f"optim.{e.key.partition('.')[2]}", e.default, e.accepts,
                        f"torch.optim.{DEFAULT_OPTIMISER}'s {e.key.partition('.')[2]}")
                  for e in signature_entries("optim", optimiser, skip=("params", "lr",
                                                                        "weight_decay")))
    return [
        Section(anchor("optim"), "optim", "The optimiser, named by its torch.optim class, and "
                "the wrapper that steps it.", own),
        Section(anchor("optim", "arguments"), f"optim: {DEFAULT_OPTIMISER}'s arguments",
                "Every other key of `optim` is an argument of the optimiser's class, checked "
                f"against its signature; for the default, torch.optim.{DEFAULT_OPTIMISER}:",
                extra),
        Section(anchor("optim", "clip_grad"), "optim.clip_grad",
                "Either `max_norm` (clip the total norm; `clip_grad: 1.0` is short for "
                "`{max_norm: 1.0}`) or `clip_value` (clip each gradient value; with `foreach` "
                "at most). Under fp16 the gradients are unscaled first; the logged `grad_norm` "
                "is the norm before clipping.",
                table_entries("optim.clip_grad", CLIP_GRAD_KEYS)
                + table_entries("optim.clip_grad", {"clip_value": CLIP_VALUE_KEYS["clip_value"]})),
        Section(anchor("optim", "paramwise"), "optim.paramwise",
                "Learning rate and weight decay per parameter, as multipliers of `optim.lr` "
                "and `optim.weight_decay`; parameters with the same rates share a group.",
                table_entries("optim.paramwise", PARAMWISE)),
        Section(anchor("optim", "paramwise", "custom_keys"), "optim.paramwise.custom_keys.<name>",
                "A part of parameters' full names, and their multipliers.",
                table_entries("optim.paramwise.custom_keys.<name>", CUSTOM_KEY_OPTIONS)),
    ]


def scheduler_sections() -> list[Section]:
    sections = [Section(anchor("scheduler"), "scheduler",
                        "`scheduler: null` keeps the rate constant. Iteration counts "
                        "(step_size, milestones, warmup_iters) are iterations whatever the "
                        "schedule counts.", table_entries("scheduler", SCHEDULER_TYPE))]
    for kind, options in SCHEDULER_OPTIONS.items():
        sections.append(Section(anchor("scheduler", kind), f"scheduler: {kind}",
                                f"`scheduler.type: {kind}`" + ("" if options else
                                                               ": no options") + ".",
                                table_entries("scheduler", options)))
    return sections


def hook_sections() -> list[Section]:
    sections = [Section(anchor("hooks"), "hooks", "A list; each item names a hook and gives "
                        "its options.", table_entries("hooks[]", ITEM))]
    for name in HOOKS:
        cls = HOOKS[name]
        meanings = docstring_args(cls)
        entries = tuple(entry if entry.meaning else replace(
            entry, meaning=meanings.get(entry.key.rpartition(".")[2], ""))
            for entry in table_entries("hooks[]", cls.OPTIONS or {}))
        sections.append(Section(anchor("hooks", name), f"hooks: {name}",
                                f"`- {{type: {name}, ...}}`; its options are its class's "
                                f"arguments.", entries))
    return sections


@functools.cache
def sections() -> tuple[Section, ...]:
    """Every section of the config, in the order the reference shows them."""
    return (top_section(), *strategy_sections(), *model_sections(), *data_sections(),
            *optim_sections(), *scheduler_sections(), *plain_sections(), *hook_sections())


# ---------------------------------------------------------------- a resolved config's keys

def flat_keys(value: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a resolved config, list items as ``key[i]``."""
    if isinstance(value, Mapping) and value:
        return [k for name, item in value.items() for k in flat_keys(item, f"{prefix}{name}.")]
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return [k for i, item in enumerate(value)
                for k in flat_keys(item, f"{prefix.rstrip('.')}[{i}].")]
    return [prefix.rstrip(".")]


def where_documented(key: str, cfg: Mapping[str, Any]) -> str | None:
    """The anchor of the section that documents ``key`` (dotted, as `flat_keys` gives it) of
    the resolved config ``cfg``; None where no section does."""
    head, _, rest = key.partition(".")
    name = rest.partition(".")[0]
    candidates: list[str] = []
    if head == "strategy":
        candidates = [anchor("strategy", cfg["strategy"]["type"]), anchor("strategy")]
    elif head == "model":
        candidates = [anchor("model"), anchor("model", str(cfg["model"].get("type")))]
    elif head == "data":
        split = name
        section = (cfg.get("data") or {}).get(split) or {}
        leaf = rest.partition(".")[2]
        if split == "val" and "type" not in section and leaf.partition(".")[0] in section:
            set_name, _, leaf = leaf.partition(".")  # a named validation set
            section = section[set_name]
        leaf = leaf.partition(".")[0]
        if not leaf:
            return anchor("data")
        candidates = [anchor("data", "split"), anchor("data", str(section.get("type")))]
        key = f"data.<split>.{leaf}"
    elif head == "optim":
        if name == "per_module" and rest.count(".") >= 2:  # per_module.<submodule>.<key>
            key = "optim." + rest.split(".", 2)[2]
        candidates = [anchor("optim"), anchor("optim", "arguments"),
                      anchor("optim", "clip_grad"), anchor("optim", "paramwise"),
                      anchor("optim", "paramwise", "custom_keys")]
        if key.startswith("optim.paramwise.custom_keys."):
            key = "optim.paramwise.custom_keys.<name>." + key.rpartition(".")[2]
    elif head == "scheduler":
        kind = (cfg.get("scheduler") or {}).get("type")
        candidates = [anchor("scheduler"), anchor("scheduler", str(kind))]
    elif head.startswith("hooks["):
        index = int(head[len("hooks["):-1])
        candidates = [anchor("hooks"), anchor("hooks", str(cfg["hooks"][index]["type"]))]
        key = f"hooks[].{rest}"
    elif head == "guard":
        candidates = [anchor("guard", "spike"), anchor("guard")]
    elif head in PLAIN_SECTIONS:
        candidates = [anchor(head)]
    else:
        candidates = [anchor("top")]
    by_anchor = {s.anchor: s for s in sections()}
    for candidate in candidates:
        section = by_anchor.get(candidate)
        if section is not None and any(e.key == key or key.startswith(e.key + ".")
                                       for e in section.entries):
            return candidate
    # a section's own key (``scheduler: null``), documented at the top level
    top = by_anchor[anchor("top")]
    return anchor("top") if any(e.key == key for e in top.entries) else None
