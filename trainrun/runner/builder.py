"""Building a run's parts (the model, data loaders, metrics) from config sections, and the
model and data sections' tables and checks.

The optimiser is the ``trainrun.runner.optim`` package's; the dry run's plan is
``trainrun.runner.plan``'s.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from trainrun.dist import get_dist_info
from trainrun.messages import first_line
from trainrun.registry import resolve
from trainrun.runner.evaluation import BaseMetric
from trainrun.runner.sample_seeds import SeededSamples
from trainrun.runner.sampler import ResumableSampler, batches_per_epoch
from trainrun.runner.schema import (
    OPTIONAL,
    REQUIRED,
    Check,
    ConfigError,
    Fields,
    bad_value,
    call_mismatch,
    check_bool,
    check_text,
    expects,
    fields,
    integer,
    join,
    names,
    nullable,
    rule,
    section,
    unknown_key,
)
from trainrun.runner.seed import seed_worker

DEFAULT_BATCH_SIZE = 32
# DataLoader options of a data section, each filled with its default; the rest (but `type`,
# `metrics` and the LOADER_OPTIONS given only when set) goes to the data set
LOADER_KEYS = ("batch_size", "num_workers", "shuffle", "drop_last", "pin_memory",
               "persistent_workers")
LOADER_OPTIONS = (*LOADER_KEYS, "collate_fn")


def _split(cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    options = dict(cfg)
    return options.pop("type"), options


def construct(key: str, kind: str, name: str, options: Mapping[str, Any],
              also_known: Sequence[str] = ()) -> Any:
    """The ``kind`` (model, dataset, ...) called ``name``, built with ``options``. What the
    config got wrong is a ConfigError naming ``key``: an unknown type, a key the class does
    not take (with the closest one it, or the section's ``also_known`` keys, does), a
    required argument missing, or values its constructor refuses (a ValueError)."""
    try:
        target = resolve(kind, name)
    except ValueError as error:
        raise ConfigError(f"{key}.type: {error}") from None
    check_arguments(key, name, target, options, also_known)
    mismatch = call_mismatch(target, **options)
    if mismatch is not None:
        raise ConfigError(f"{key}: {name} does not take these arguments: {mismatch}")
    try:
        return target(**options)
    except ValueError as error:
        raise ConfigError(f"{key}: {name} refused its arguments: {first_line(error)}") from None


def check_arguments(key: str, name: str, target: Any, options: Mapping[str, Any],
                    also_known: Sequence[str] = ()) -> None:
    """Check the keys of the config section ``key`` that go to ``target`` (``options``)
    against its signature, before it is called: a key it does not take is a ConfigError
    naming it, with the closest of its arguments and of the section's other keys
    (``also_known``, e.g. a data section's loader options) as a "did you mean"; a required
    argument that ``options`` lack is one naming it. A target that takes ``**kwargs`` passes
    any key on, so only what it requires is checked; one whose signature cannot be read is
    left to its call.

    Args:
        key: the section's dotted key (``model``, ``data.train``), for messages.
        name: the section's ``type`` as the config wrote it, for messages.
        target: the class (or function) ``name`` stands for.
        options: the section's keys that are passed to ``target``.
        also_known: the section's other keys, offered as suggestions too.

    Raises:
        ConfigError: a key ``target`` does not take, or a required argument missing.
    """
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin or extension type: its call will tell
        return
    by_keyword = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        taken = {p.name for p in by_keyword}
        for option in options:
            if option not in taken:
                raise unknown_key(key, option, [*also_known, *(p.name for p in by_keyword)])
    for param in by_keyword:
        if param.default is param.empty and param.name not in options:
            raise ConfigError(f"{join(key, param.name)}: missing; {name} needs it (an "
                              f"argument without a default)")


def build_model(cfg: Mapping[str, Any]) -> nn.Module:
    name, options = _split(cfg)
    return construct("model", "model", name, options)


def build_dataloader(cfg: Mapping[str, Any], seed: int, train: bool,
                     key: str = "data", ranks: tuple[int, int] | None = None) -> DataLoader:
    """A loader over the data set ``cfg`` (the config's ``key``) names, dealt to ranks by a
    `ResumableSampler`.

    The loader gets a generator of its own (re-seeded every epoch by the loop), so building
    iterators never draws from the global random stream. A training loader with workers reads
    every sample under a seed of its own (`SeededSamples`): in the workers, random
    augmentation would otherwise depend on which worker served which batch since the epoch
    (or the resumed run) began. Without workers the data set draws from the main process's
    streams, which checkpoints save. ``ranks`` is (this rank's place, the places) the data is
    dealt to, where ranks share batches (tensor parallelism); None: (rank, world size).
    """
    rank, world_size = ranks or get_dist_info()
    if "dataset" in cfg:  # built already (check_built_set)
        dataset = cfg["dataset"]
        name, loader = type(dataset).__name__, {k: v for k, v in cfg.items() if k != "dataset"}
    else:
        name, options = _split(cfg)
        loader = {option: options.pop(option) for option in LOADER_OPTIONS if option in options}
        options.pop("metrics", None)
        section_keys = ("type", *LOADER_OPTIONS, *(() if train else ("metrics",)))
        dataset = construct(key, "dataset", name, options, also_known=section_keys)
    if isinstance(dataset, IterableDataset):
        return _stream_loader(dataset, key, name, train, loader, rank, world_size)
    shuffle = loader.pop("shuffle", train)
    num_workers = loader.get("num_workers", 0)
    seeded = train and num_workers > 0
    sampler = ResumableSampler(len(dataset), shuffle=shuffle, seed=seed, num_replicas=world_size,
                               rank=rank, sample_seeds=seeded)
    if seeded:
        dataset = SeededSamples(dataset)
    return DataLoader(
        dataset,
        batch_size=loader.get("batch_size", DEFAULT_BATCH_SIZE),
        sampler=sampler,
        collate_fn=collate_function(f"{key}.collate_fn", loader.get("collate_fn")),
        num_workers=num_workers,
        drop_last=loader.get("drop_last", False) and train,
        pin_memory=loader.get("pin_memory", False),
        persistent_workers=loader.get("persistent_workers", False) and num_workers > 0,
        worker_init_fn=seed_worker,
        generator=torch.Generator(),
    )


def _stream_loader(dataset: IterableDataset, key: str, name: str, train: bool,
                   loader: dict[str, Any], rank: int, world_size: int) -> DataLoader:
    """A loader over this rank's share of a stream (see `trainrun.runner.stream`); only for
    training, where a stream is read once through in step on every rank."""
    from trainrun.runner.stream import build_stream_loader

    if not train:
        raise ConfigError(f"{key}.type: {name} is an IterableDataset; {STREAM_ONLY_TRAIN}")
    return build_stream_loader(
        dataset, key, rank, world_size, loader.get("batch_size", DEFAULT_BATCH_SIZE),
        loader.get("drop_last", False), loader,
        collate_fn=collate_function(f"{key}.collate_fn", loader.get("collate_fn")),
        worker_init_fn=seed_worker, generator=torch.Generator())


def _resolved(key: str, kind: str, name: str) -> Any:
    """``resolve(kind, name)``, its error a ConfigError naming ``key``."""
    try:
        return resolve(kind, name)
    except ValueError as error:
        raise ConfigError(f"{key}: {error}") from None


def collate_function(key: str, value: str | Mapping[str, Any] | None) -> Any:
    """The function a ``collate_fn`` value names (None: torch's default): a registered name
    or an import path, or ``{type: ..., **options}`` with the options bound by
    `functools.partial`. Imported and checked (callable, takes a batch and the options) here,
    so a wrong one is a ConfigError naming ``key`` before anything runs."""
    if value is None:
        return None
    name, options = (value, {}) if isinstance(value, str) else _split(value)
    named = key if isinstance(value, str) else f"{key}.type"
    target = _resolved(named, "collate", name)
    if not callable(target):
        raise ConfigError(f"{named}: {name} is a {type(target).__name__}, expected a function "
                          f"that takes a batch (a list of samples)")
    mismatch = call_mismatch(target, None, **options)  # the batch, then the options
    if mismatch is not None:
        raise ConfigError(f"{key}: {name} does not take a batch and these options "
                          f"({', '.join(options) or 'none'}): {mismatch}")
    return partial(target, **options) if options else target


def build_metrics(cfg: Mapping[str, Any] | None, dataset: Any,
                  key: str = "data") -> list[BaseMetric]:
    """The metrics a val/test section (the config's ``key``) names, else those its data set
    declares."""
    names = list((cfg or {}).get("metrics") or getattr(dataset, "DEFAULT_METRICS", []))
    return [_resolved(f"{key}.metrics", "metric", name)() for name in names]


def check_types(cfg: Mapping[str, Any]) -> None:
    """Import every class the config names (model, data sets, metrics) without building any,
    and check the keys each is given against its signature (`check_arguments`), so that a
    misspelt or missing class, a key it does not take, or an argument it needs is a
    ConfigError naming its key before anything runs (the dry run included)."""
    model_name, model_options = _split(cfg["model"])
    model = _resolved("model.type", "model", model_name)
    check_arguments("model", model_name, model, model_options)
    for key, loader in data_sections(cfg.get("data") or {}):
        dataset = _resolved(f"{key}.type", "dataset", loader["type"])
        check_stream_class(key, dataset, cfg.get("schedule") or {})
        collate_function(f"{key}.collate_fn", loader.get("collate_fn"))
        for name in loader.get("metrics") or []:
            _resolved(f"{key}.metrics", "metric", name)
        table = loader_table(key.split(".")[1])  # the section's own keys; the rest go to it
        check_arguments(key, loader["type"], dataset,
                        {k: v for k, v in loader.items() if k not in table}, also_known=table)


STREAM_ONLY_TRAIN = ("streams are read for data.train only: validation and test score every "
                     "sample once, which needs a map-style data set (__len__ and "
                     "__getitem__)")


def check_stream_class(key: str, dataset: Any, schedule: Mapping[str, Any]) -> None:
    """An IterableDataset class where a stream cannot serve: under data.val or data.test, or
    for data.train without a length under an epoch-based schedule; a ConfigError naming the
    key. (A class is looked at; `stream_schedule` sees the built data set.)"""
    if not (isinstance(dataset, type) and issubclass(dataset, IterableDataset)):
        return
    if key != "data.train":
        raise ConfigError(f"{key}.type: {dataset.__name__} is an IterableDataset; "
                          f"{STREAM_ONLY_TRAIN}")
    if not hasattr(dataset, "__len__"):
        unsized_epochs(dataset.__name__, schedule.get("max_iters"))


def unsized_epochs(name: str, max_iters: int | None) -> None:
    """An epoch-based schedule over a stream without a length is a ConfigError naming
    schedule.max_epochs: an epoch's end is unknown until the stream runs out."""
    if max_iters is None:
        raise ConfigError(f"schedule.max_epochs: data.train ({name}) is a stream without a "
                          f"length (an IterableDataset without __len__), so the number of "
                          f"steps of an epoch-based schedule is unknown; set "
                          f"schedule.max_iters instead")


def data_sections(data: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Each data section of a checked ``data`` config with its dotted key (several
    validation sets each as ``data.val.<name>``)."""
    found = []
    for split, loader in data.items():
        if not loader:
            continue
        if split == "val" and "type" not in loader:
            found += [(f"data.val.{name}", section) for name, section in loader.items()]
        else:
            found.append((f"data.{split}", loader))
    return found


def check_batches(key: str, dataset_length: int, world_size: int, batch_size: int,
                  drop_last: bool) -> None:
    """A ConfigError naming ``key`` when its data set leaves no batch for a rank to train on
    (a batch larger than each rank's share, with drop_last; or no data)."""
    if batches_per_epoch(dataset_length, world_size, batch_size, drop_last) > 0:
        return
    if dataset_length == 0:
        raise ConfigError(f"{key}: the training set is empty: there is nothing to train on")
    share = -(-dataset_length // world_size)
    ranks = f", {share} per process on {world_size} processes" if world_size > 1 else ""
    raise ConfigError(f"{key}.batch_size: got {batch_size}, more than the {dataset_length} "
                      f"samples of the training set{ranks}; with drop_last: true no batch is "
                      f"left to train on: set batch_size to at most {share}, or drop_last "
                      f"to false")


# ---------------------------------------------------------------- the model and data sections

check_type_name = rule("a non-empty string (a registered name or a dotted import path)",
                       lambda v: isinstance(v, str) and v.strip() != "")
check_model_section = expects("a mapping with a 'type'",
                              section({"type": (REQUIRED, check_type_name)}, open_=True))
COLLATE_EXPECTED = ("a function's registered name or import path, or a mapping with its "
                    "'type' and options")


def check_collate(key: str, value: Any) -> str | dict[str, Any]:
    """A ``collate_fn`` value's shape (`collate_function` imports and binds it)."""
    if isinstance(value, Mapping):
        return fields(key, value, {"type": (REQUIRED, check_type_name)}, open_=True)
    return check_type_name(key, value)


check_collate_fn = expects(COLLATE_EXPECTED, check_collate)


def loader_table(split: str) -> Fields:
    table: Fields = {
        "type": (REQUIRED, check_type_name,
                 "the data set's class: a built-in name (digits, char_corpus, char_lines, "
                 "gaussian_mixture) or my_module.MyDataset"),
        "batch_size": (DEFAULT_BATCH_SIZE, integer(1), "samples per batch, on each rank"),
        "num_workers": (0, integer(0),
                        "DataLoader worker processes (0: load in the training process)"),
        "shuffle": (split == "train", check_bool,
                    "a new order every epoch, the same on every rank (from the run's seed)"),
        "drop_last": (False, check_bool, "drop each epoch's last, smaller batch (training only)"),
        "pin_memory": (False, check_bool, "page-locked batches, for faster copies to a GPU"),
        "persistent_workers": (False, check_bool,
                               "keep the workers alive between epochs (needs num_workers > 0)"),
        # absent unless given: the configs of runs made before it say the same when resumed
        "collate_fn": (OPTIONAL, nullable(check_collate_fn),
                       "how samples become a batch: default, pad_sequences, a function by "
                       "import path, or {type: ..., options} (default: torch's collate)"),
    }
    if split != "train":
        table["metrics"] = (None, nullable(names(check_text)),
                            "what to score: accuracy, mean, val_loss, mode_distance or a metric "
                            "by import path (default: the data set's DEFAULT_METRICS)")
    return table


def check_loader(key: str, value: Any, split: str, warnings: list[str]) -> dict[str, Any]:
    """A data section: the data set's type, its DataLoader options and any data set kwargs;
    or, from Python, a data set already built (``dataset``) and its DataLoader options."""
    if isinstance(value, Mapping) and "dataset" in value:
        return check_built_set(key, value, split)
    if split == "train" and isinstance(value, Mapping) and "metrics" in value:
        raise bad_value(f"{key}.metrics", value["metrics"],
                        "no metrics on the train section (they belong under data.val or data.test)")
    out = fields(key, value, loader_table(split), open_=True)
    if out["persistent_workers"] and out["num_workers"] == 0:
        raise bad_value(f"{key}.persistent_workers", True, f"false when {key}.num_workers is 0")
    for name in out:
        if name not in loader_table(split):
            hint = difflib.get_close_matches(str(name), LOADER_OPTIONS, n=1, cutoff=0.8)
            if hint:
                warnings.append(f"{join(key, name)} is passed to the data set; "
                                f"did you mean '{join(key, hint[0])}'?")
    return out


def check_built_set(key: str, value: Mapping[str, Any], split: str) -> dict[str, Any]:
    """A data section that holds a built data set object under ``dataset`` (the Python API's
    shape, used by ``trainrun.compat.mmengine``): its other keys are DataLoader options only."""
    dataset = value["dataset"]
    if not (isinstance(dataset, IterableDataset)
            or (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))):
        raise bad_value(f"{key}.dataset", dataset,
                        "a data set object (with __getitem__ and __len__, or an IterableDataset)")
    if "type" in value:
        raise ConfigError(f"{key}: give either type (and the data set's options) or dataset "
                          f"(a built data set), not both")
    table = {name: entry for name, entry in loader_table(split).items() if name != "type"}
    return {"dataset": dataset, **fields(key, {k: v for k, v in value.items() if k != "dataset"},
                                         table)}


SET_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # no '/': it separates val/<name>/<metric>


def named_sets(value: Any) -> bool:
    """Whether a ``data.val`` value is a mapping of named sections (or loaders) rather than one
    section: it has no ``type`` and no key of a section, and each of its values is a mapping
    (or a DataLoader)."""
    return (isinstance(value, Mapping) and bool(value) and "type" not in value
            and not set(value) & set(loader_table("val"))
            and all(isinstance(v, (Mapping, DataLoader)) for v in value.values()))


def check_val(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    """``data.val``: one data section, or a mapping of named sections (several validation
    sets, each with its own metrics, logged as ``val/<name>/<metric>``)."""
    if not named_sets(value):
        return check_loader(key, value, "val", warnings)
    return {check_set_name(key, name): check_loader(join(key, name), section, "val", warnings)
            for name, section in value.items()}


def check_set_name(key: str, name: Any) -> str:
    """A validation set's ``name`` under ``key``: it becomes part of the logged names."""
    if not (isinstance(name, str) and SET_NAME.match(name)):
        raise bad_value(join(key, name), name, "a validation set's name: letters, digits, "
                        "'_', '-' or '.' (no '/', which separates val/<name>/<metric>)")
    return name


def check_data(key: str, value: Any, mode: str, warnings: list[str]) -> dict[str, Any]:
    def split(name: str) -> tuple[Any, Check]:
        loader = partial(check_val, warnings=warnings) if name == "val" else \
            partial(check_loader, split=name, warnings=warnings)
        check = expects("a data section with a 'type'" + (", or a mapping of named data "
                        "sections" if name == "val" else ""), loader)
        needed = (mode == "train" and name == "train") or (mode == "test" and name == "test")
        return (REQUIRED, check) if needed else (None, nullable(check))

    return fields(key, value, {name: split(name) for name in ("train", "val", "test")})
