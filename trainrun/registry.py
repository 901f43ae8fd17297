"""Every kind of name a config can give, and what each name stands for: one registry per kind.

A config names a part by a short name (``model.type: DigitsMLP``, ``strategy.type: fsdp``) or
by an import path (``my_project.models.Net``). Each registry below maps the short names of
one kind to their objects. The registries are empty until first asked: the first lookup
imports the modules listed as the registry's locations, which register the shipped names
(the examples register the models and data sets, ``trainrun.wrappers`` the strategies, and so
on). So this module imports nothing of trainrun, every layer above ``dist/`` can use it, and
adding a strategy, a format, a hook or a tracker is one new file plus one ``register`` line.

A name may be registered with the object itself or, to keep start-up light, with where it
lives (``"package.module:Class"``), imported when a config asks for it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

from trainrun.messages import closest

# packages of trainrun's optional extras (pyproject.toml) that registered modules import: a
# class whose module needs a missing one cannot be named, and the error says what installs it
EXTRAS: dict[str, str] = {"transformers": "hf"}


class MissingModule(ValueError):
    """A ``type:`` import path whose module (or one of its parent packages) cannot be found."""


class Registry(MutableMapping[str, Any]):
    """The short names of one kind of part and what each stands for.

    It behaves as a mapping from name to object: ``registry[name]`` imports a target given
    as ``"module:attribute"`` and, for a name registered with default options, returns a
    ``functools.partial`` of it. ``registry[name] = obj`` registers ``obj`` under ``name``.

    Args:
        kind: what the names are, in the singular, as messages say it (``"model"``).
        locations: modules that register this kind's shipped names; imported on the first
            lookup, so that naming the registry costs nothing at start-up.
    """

    def __init__(self, kind: str, locations: Sequence[str] = ()) -> None:
        self.kind = kind
        self.locations = tuple(locations)
        self._entries: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._loaded = not self.locations

    def register(self, name: str, target: Any, /, **defaults: Any) -> None:
        """Make ``name`` stand for ``target``.

        Args:
            name: the short name a config gives.
            target: the object, or where it lives (``"package.module:attribute"``).
            **defaults: keyword options the name implies (``MeanOf`` registered as
                ``val_loss`` with ``name="val_loss"``).
        """
        self._entries[name] = (target, defaults)

    def target(self, name: str) -> Any:
        """What ``name`` was registered with, not imported (``"module:attribute"`` or the
        object); KeyError for a name not registered."""
        self._load()
        return self._entries[name][0]

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # before importing: a location may look itself up
            for location in self.locations:
                importlib.import_module(location)

    def __getitem__(self, name: str) -> Any:
        self._load()
        target, defaults = self._entries[name]
        found = import_target(target, self.kind, shown=name) if isinstance(target, str) \
            else target
        return functools.partial(found, **defaults) if defaults else found

    def __setitem__(self, name: str, target: Any) -> None:
        self.register(name, target)

    def __delitem__(self, name: str) -> None:
        self._load()
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self)})"


MODELS = Registry("model", ["trainrun.examples"])
DATASETS = Registry("dataset", ["trainrun.examples"])
METRICS = Registry("metric", ["trainrun.runner.evaluation"])
HOOKS = Registry("hook", ["trainrun.runner.hooks"])
COLLATES = Registry("collate", ["trainrun.runner.collate"])
TRACKERS = Registry("tracker", ["trainrun.runner.trackers"])
STRATEGIES = Registry("strategy", ["trainrun.wrappers"])
FORMATS = Registry("checkpoint format", ["trainrun.checkpoint"])

# the registries a config's ``type:`` keys look names up in, by kind
REGISTRIES: dict[str, Registry] = {r.kind: r for r in (MODELS, DATASETS, METRICS, HOOKS,
                                                       COLLATES, TRACKERS, STRATEGIES, FORMATS)}


def resolve(kind: str, name: str) -> Any:
    """What ``name`` stands for among the names of ``kind``: a registered object (a
    ``functools.partial`` of it for a name with default options) or one by import path.

    Args:
        kind: one of ``REGISTRIES``' keys (``"model"``, ``"dataset"``, ``"metric"``,
            ``"hook"``, ``"collate"``, ...).
        name: a registered short name or, when it contains a dot, an import path
            ``pkg.module.Class`` or ``pkg.module:Class``; from Python, the class (or any
            callable) itself, returned as it is.

    Returns:
        The object; call it with the config section's remaining options.

    Raises:
        ValueError: an unknown kind, or a name that is neither registered nor importable
            (the message names the kind, the name, a close registered name and the
            choices).
    """
    if kind not in REGISTRIES:
        raise ValueError(f"unknown registry kind {kind!r}; the kinds are: "
                         f"{', '.join(REGISTRIES)}")
    if callable(name) and not isinstance(name, str):
        return name
    registry = REGISTRIES[kind]
    if name in registry:
        return registry[name]
    if "." in name or ":" in name:
        try:
            return import_target(name, kind)
        except MissingModule:
            raise  # its hint says where modules are looked for; the registry is beside it
        except ValueError as error:
            sep = " " if str(error).endswith("?") else ". "
            raise ValueError(f"{error}{sep}{_registered(registry)}") from None
    hint = closest(name, registry, cutoff=0.5)
    raise ValueError(f"unknown {kind} type {name!r}"
                     + (f"; did you mean {hint!r}?" if hint else ".")
                     + f" {_registered(registry)}; any other class is named by its "
                     f"import path, e.g. 'my_project.module.ClassName'")


def import_target(path: str, kind: str = "object", shown: str | None = None) -> Any:
    """The object at ``pkg.module:attr`` (or ``pkg.module.attr``), imported now.

    Args:
        path: where the object lives.
        kind: what it is, as error messages name it.
        shown: the name the config wrote, for messages (default: ``path``).

    Returns:
        The object.

    Raises:
        MissingModule: the module (or a parent package) cannot be found; the message says
            where modules are looked for.
        ValueError: the module lacks the attribute, or needs a package of an optional extra
            (``EXTRAS``) that is not installed (the message names the extra to install).
            Any other import error raised inside an existing module is passed on
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


def _registered(registry: Registry) -> str:
    return f"Registered {registry.kind}s: {', '.join(sorted(registry))}"


__all__ = ["COLLATES", "DATASETS", "EXTRAS", "FORMATS", "HOOKS", "METRICS", "MODELS",
           "REGISTRIES", "STRATEGIES", "TRACKERS", "MissingModule", "Registry",
           "import_target", "resolve"]
