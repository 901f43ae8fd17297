"""The built-in models, data sets, metrics and hooks, by the short names configs use.

Each registry maps a short name to where the object lives (``"module:attribute"``), so
importing this package imports no model: `resolve` imports only what a config asks for. A
config's ``type`` may also be a dotted import path (``pkg.module.Class`` or
``pkg.module:Class``), which is how a researcher's own classes are used.

Metrics carry default keyword options, because one class serves several names
(``MeanOf(name='val_loss')`` and ``MeanOf(name='mode_distance')``).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

from trainrun.dist.text import closest

MODELS: dict[str, str] = {
    "DigitsMLP": "trainrun.examples.digits:DigitsMLP",
    "HFGPT2": "trainrun.examples.hf_gpt2:HFGPT2",  # needs the extra hf (transformers)
    "TinyLM": "trainrun.examples.tinylm:TinyLM",
    "ToyGAN": "trainrun.examples.gan:ToyGAN",
}

DATASETS: dict[str, str] = {
    "digits": "trainrun.examples.digits:DigitsDataset",
    "char_corpus": "trainrun.examples.tinylm:CharCorpus",
    "char_lines": "trainrun.examples.tinylm:CharLines",
    "gaussian_mixture": "trainrun.examples.gan:GaussianMixture",
}

# name -> (where the class lives, the keyword options that name implies)
METRICS: dict[str, tuple[str, dict[str, Any]]] = {
    "accuracy": ("trainrun.runner.evaluation:Accuracy", {}),
    "mean": ("trainrun.runner.evaluation:MeanOf", {}),
    "val_loss": ("trainrun.runner.evaluation:MeanOf", {"name": "val_loss"}),
    "mode_distance": ("trainrun.runner.evaluation:MeanOf", {"name": "mode_distance"}),
}

# the hooks a config's ``hooks:`` list names (trainrun/runner/hooks/)
HOOKS: dict[str, str] = {
    "EMA": "trainrun.runner.hooks.ema:EMAHook",
    "EarlyStopping": "trainrun.runner.hooks.early_stopping:EarlyStoppingHook",
    "Profiler": "trainrun.runner.hooks.profiler:ProfilerHook",
}


# functions a data section's ``collate_fn`` names (any other by its import path)
COLLATES: dict[str, str] = {
    "default": "torch.utils.data:default_collate",
    "pad_sequences": "trainrun.runner.collate:pad_sequences",
}


# packages of trainrun's optional extras (pyproject.toml) that example modules import: a
# class whose module needs a missing one cannot be named, and the error says what installs it
EXTRAS: dict[str, str] = {"transformers": "hf"}


REGISTRIES: dict[str, dict[str, Any]] = {"model": MODELS, "dataset": DATASETS, "metric": METRICS,
                                         "hook": HOOKS, "collate": COLLATES}


def resolve(kind: str, name: str) -> Any:
    """The class (or, for a metric with default options, a `functools.partial` of it) that
    ``name`` stands for; call it with the config section's remaining options.

    ``kind`` is ``'model'``, ``'dataset'``, ``'metric'``, ``'hook'`` or ``'collate'``.
    ``name`` is a short name of that registry, or, when it contains a dot, an import path
    ``pkg.module.Class`` or ``pkg.module:Class``. Raises ValueError naming the kind, the name
    and the choices.
    """
    if kind not in REGISTRIES:
        raise ValueError(f"unknown registry kind {kind!r}; the kinds are: "
                         f"{', '.join(REGISTRIES)}")
    registry = REGISTRIES[kind]
    if name in registry:
        target, defaults = _entry(registry[name])
        found = import_target(target, kind, shown=name)
        return functools.partial(found, **defaults) if defaults else found
    if "." in name or ":" in name:
        try:
            return import_target(name, kind)
        except MissingModule:
            raise  # its hint says where modules are looked for; the registry is beside it
        except ValueError as error:
            sep = " " if str(error).endswith("?") else ". "
            raise ValueError(f"{error}{sep}{_registered(kind, registry)}") from None
    hint = closest(name, registry, cutoff=0.5)
    raise ValueError(f"unknown {kind} type {name!r}"
                     + (f"; did you mean {hint!r}?" if hint else ".")
                     + f" {_registered(kind, registry)}; any other class is named by its "
                     f"import path, e.g. 'my_project.module.ClassName'")


class MissingModule(ValueError):
    """A ``type:`` import path whose module (or one of its parent packages) cannot be found."""


def _entry(entry: str | tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """A registry entry as (target, default options)."""
    return (entry, {}) if isinstance(entry, str) else entry


def import_target(path: str, kind: str = "object", shown: str | None = None) -> Any:
    """The object at ``pkg.module:attr`` (or ``pkg.module.attr``), imported now.

    A module that is missing (``MissingModule``, which says where modules are looked for), or
    an attribute the module lacks, is a ValueError naming ``kind`` and ``path``; so is a
    module that needs a package of an optional extra (`EXTRAS`) that is not installed, the
    error naming the extra to install and ``shown`` (the name the config wrote; default
    ``path``). Any other import error raised inside an existing module is passed on
    unchanged, since that is the module's own fault.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"{kind} type {path!r} is not an import path like 'pkg.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        package = (error.name or "").partition(".")[0]
        if package in EXTRAS:
            raise ValueError(f"{kind} type {shown or path!r} needs {package}, which is not "
                             f"installed: pip install 'trainrun[{EXTRAS[package]}]'") from None
        if error.name is None or not _is_prefix(error.name, module_name):
            raise
        raise MissingModule(f"{kind} type {path!r}: no module named {error.name!r}"
                            f"{_where_modules_are(error.name, module_name)}") from None
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            hint = closest(part, [n for n in dir(found) if not n.startswith("_")], cutoff=0.5)
            owner = getattr(found, "__name__", repr(found))
            raise ValueError(f"{kind} type {path!r}: {owner} has no attribute {part!r}"
                             + (f"; did you mean {hint!r}?" if hint else ""))
        found = getattr(found, part)
    return found


def _is_prefix(missing: str, module_name: str) -> bool:
    """Whether the module that could not be found is ``module_name`` or one of its parents."""
    return module_name == missing or module_name.startswith(missing + ".")


def _where_modules_are(missing: str, module_name: str) -> str:
    """A hint, for a top-level module that cannot be found, on where ``type:`` paths are
    imported from (the command lines put the working directory first on sys.path, as
    ``python -m`` does); nothing for a submodule of a package that was found."""
    if "." in missing:
        return ""
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed
        return ""
    holder = f"{missing}.py" if missing == module_name else f"{missing}/"
    if any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        return (f" (type: paths are imported from the working directory, {cwd}, and "
                f"PYTHONPATH; run trainrun from the directory that holds {holder}, or add "
                f"its directory to PYTHONPATH)")
    return (f" (type: paths are imported from sys.path, which does not hold the working "
            f"directory, {cwd}, here; add the directory that holds {holder} to PYTHONPATH)")


def _registered(kind: str, registry: dict[str, Any]) -> str:
    return f"Registered {kind}s: {', '.join(sorted(registry))}"


__all__ = ["COLLATES", "DATASETS", "EXTRAS", "HOOKS", "METRICS", "MODELS", "REGISTRIES",
           "MissingModule", "import_target", "resolve"]
