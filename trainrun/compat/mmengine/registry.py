"""MMEngine's registries (``mmengine.registry``): one per kind of part a training script builds.

Code written for MMEngine registers its classes with ``@MODELS.register_module()`` and builds
them from config dicts with ``MODELS.build(dict(type='Name', ...))``; with these registries it
does so unchanged. Each registry keeps its names in a ``trainrun.registry.Registry``, and the
kinds trainrun has too share trainrun's own: a model, data set, metric or hook registered here
is also a name a trainrun YAML config can give (``model.type: Name``), and trainrun's shipped
names can be built from here. The other kinds (optimisers, loops, wrappers, ...) have
registries of their own, since trainrun's names for them stand for other things.

``OPTIMIZERS`` knows ``torch.optim``'s optimisers by their class names (``SGD``, ``AdamW``,
...), and ``FUNCTIONS`` the collate functions ``default_collate`` and ``pseudo_collate`` of
``trainrun.compat.mmengine.dataset``, imported when first asked for. A downstream code base's
registry (``Registry('model', parent=MODELS, scope='mmdet')``) shares its parent's names: there
are no scopes (``default_scope``, ``'mmdet.ResNet'``), and a dotted type is an import path.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from trainrun import registry as trainrun_registry
from trainrun.messages import closest


class Registry:
    """Short names of one kind of part, MMEngine-style: register with ``register_module``,
    look up with ``get`` and ``in``, build from a config dict with ``build``.

    Args:
        name: what the names are (``"model"``), as messages say it.
        build_func: what ``build`` calls, as ``build_func(cfg, *args, registry=self,
            **kwargs)``; None: ``build_from_cfg``.
        locations: modules that register this kind's names; imported on the first lookup.
        backend: a trainrun registry to keep the names in, shared with trainrun's configs;
            None: a registry of its own.
        parent: the registry a downstream code base's registry extends (MMEngine's
            ``Registry('model', parent=MODELS, scope='mmdet')``): the two share their names,
            since trainrun has no scopes (a name registered twice is refused as usual).
        scope: the code base's name, kept as ``scope``; names are not prefixed with it.
    """

    def __init__(self, name: str, build_func: Callable[..., Any] | None = None,
                 locations: Sequence[str] = (),
                 backend: trainrun_registry.Registry | None = None,
                 parent: Registry | None = None, scope: str | None = None) -> None:
        self._name = name
        self.scope = scope
        if parent is not None:
            build_func = build_func if build_func is not None else parent.build_func
            backend = parent.backend
        self.build_func = build_func if build_func is not None else build_from_cfg
        self.backend = backend if backend is not None else trainrun_registry.Registry(name)
        self._locations = tuple(locations)  # a backend's own are imported by the backend

    @property
    def name(self) -> str:
        """What the names are, as messages say it (``"model"``)."""
        return self._name

    def _load(self) -> None:
        if self._locations:
            locations, self._locations = self._locations, ()  # a location may look itself up
            for location in locations:
                importlib.import_module(location)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load()
        return sorted(self.backend)

    def __len__(self) -> int:
        self._load()
        return len(self.backend)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self.backend

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry(name={self._name!r}, names={self.names()})"

    def get(self, key: str) -> Any:
        """What ``key`` stands for: a registered name, or an import path (``pkg.module.Class``).

        Args:
            key: a registered name or a dotted import path.

        Returns:
            The class or function, or None when ``key`` is neither registered nor importable.

        Raises:
            TypeError: when ``key`` is not a string.
            ValueError: when a registered name's module needs an optional extra that is not
                installed (the message names it).
        """
        if not isinstance(key, str):
            raise TypeError(f"Registry.get takes a name (str); got {type(key).__name__}")
        if key in self:
            return self.backend[key]
        if "." in key or ":" in key:
            try:
                return trainrun_registry.import_target(key, self._name)
            except (ImportError, ValueError):  # MissingModule is a ValueError
                return None
        return None

    def register_module(self, name: str | Sequence[str] | None = None, force: bool = False,
                        module: Any = None) -> Any:
        """Register a class or function under its own name or ``name``.

        Used as a decorator (``@MODELS.register_module()``, ``@MODELS.register_module(
        name='X', force=True)``) or called with the object (``MODELS.register_module(
        module=Net)``).

        Args:
            name: the name, or several names, to register under; None: ``module.__name__``.
            force: replace what a name already stands for instead of refusing.
            module: the object to register now; None: return a decorator that registers.

        Returns:
            ``module`` when given, else the decorator (which returns what it decorates).

        Raises:
            TypeError: when ``force`` is not a bool, ``name`` is not a string or strings, or
                the object is not callable.
            KeyError: when a name is already registered and ``force`` is False; the message
                names it and what it stands for.
        """
        if not isinstance(force, bool):
            raise TypeError(f"force must be a bool; got {type(force).__name__}")
        if not (name is None or isinstance(name, str) or (
                isinstance(name, Sequence) and all(isinstance(n, str) for n in name))):
            raise TypeError(f"name must be None, a str or a sequence of str; got "
                            f"{type(name).__name__}")

        def register(obj: Any) -> Any:
            self._register(obj, name, force)
            return obj

        return register if module is None else register(module)

    def _register(self, obj: Any, name: str | Sequence[str] | None, force: bool) -> None:
        if not callable(obj):
            raise TypeError(f"only a class or function can be registered; got "
                            f"{type(obj).__name__}")
        names = [obj.__name__] if name is None else [name] if isinstance(name, str) else name
        if not force:
            for each in names:
                if each in self:
                    raise KeyError(f"{each!r} is already registered in the {self._name} "
                                   f"registry (as {_where(self.backend.target(each))}); pass "
                                   f"force=True to replace it")
        for each in names:
            self.backend.register(each, obj)

    def build(self, cfg: Mapping[str, Any] | Sequence[Mapping[str, Any]], *args: Any,
              **kwargs: Any) -> Any:
        """Build what ``cfg`` describes, through this registry's ``build_func``.

        Args:
            cfg: a dict with a ``type`` (a registered name, an import path, or the class or
                function itself) and the keyword arguments to call it with. ``MODELS`` also
                takes a list of them (built into a ``torch.nn.Sequential``).
            *args: passed on to ``build_func`` (``build_from_cfg``: ``default_args``).
            **kwargs: passed on to ``build_func``.

        Returns:
            What was built.
        """
        return self.build_func(cfg, *args, **kwargs, registry=self)

    def unknown(self, name: str) -> KeyError:
        """The error for a type ``name`` this registry cannot find: it names the registry
        and the name, offers the closest registered name and lists them all."""
        names = self.names()
        hint = closest(name, names, cutoff=0.5)
        reason = ""
        if "." in name or ":" in name:
            try:
                trainrun_registry.import_target(name, self._name)
            except (ImportError, ValueError) as error:
                reason = f" ({error})"
        return KeyError(f"{name!r} is not in the {self._name} registry{reason}"
                        + (f"; did you mean {hint!r}?" if hint else ".")
                        + f" Registered: {', '.join(names) or 'none'}; register a class with "
                        f"register_module() or give its import path")


def _where(target: Any) -> str:
    """Where a registered object lives, for a message."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or repr(target)
    return f"{module}.{qualname}" if module else qualname


def _merged_args(cfg: Any, default_args: Mapping[str, Any] | None,
                 what: str) -> dict[str, Any]:
    """``cfg``'s keys over ``default_args``', after checking both are mappings."""
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{what}: cfg must be a dict; got {type(cfg).__name__}")
    if default_args is not None and not isinstance(default_args, Mapping):
        raise TypeError(f"{what}: default_args must be a dict or None; got "
                        f"{type(default_args).__name__}")
    args = dict(default_args or {})
    args.update(cfg)
    args.pop("_scope_", None)  # scopes are not supported: the registry is the one asked
    return args


def _find(registry: Registry, obj_type: Any) -> Any:
    """The class or function a ``type`` value stands for in ``registry``."""
    if isinstance(obj_type, str):
        found = registry.get(obj_type)
        if found is None:
            raise registry.unknown(obj_type)
        return found
    if callable(obj_type):
        return obj_type
    raise TypeError(f"type must be a name (str) or a class or function; got "
                    f"{type(obj_type).__name__}")


def build_from_cfg(cfg: Mapping[str, Any], registry: Registry,
                   default_args: Mapping[str, Any] | None = None) -> Any:
    """Call the class or function ``cfg['type']`` names with the rest of ``cfg``.

    ``cfg``'s keys win over ``default_args``'; the ``type`` may come from either. A class
    with a ``get_instance`` class method (MMEngine's ``ManagerMixin``: visualisers, message
    hubs) is built through it, so that later calls find the same instance.

    Args:
        cfg: a dict with ``type`` (a name in ``registry``, an import path, or the class or
            function itself) and the keyword arguments.
        registry: where names are looked up.
        default_args: keyword arguments for what ``cfg`` does not give.

    Returns:
        The object built (or what the function returned).

    Raises:
        TypeError: ``cfg`` or ``default_args`` is not a dict, ``registry`` is not a
            ``Registry``, or ``type`` is neither a name nor callable.
        KeyError: no ``type`` in ``cfg`` or ``default_args``, or a name ``registry`` does not
            know (the message names the registry, the name and the closest registered one).
    """
    if not isinstance(registry, Registry):
        raise TypeError(f"registry must be a trainrun.compat.mmengine.registry.Registry; got "
                        f"{type(registry).__name__}")
    args = _merged_args(cfg, default_args, f"building a {registry.name}")
    if "type" not in args:
        raise KeyError(f"building a {registry.name}: the config has no 'type' (nor do the "
                       f"default_args): {dict(cfg)}")
    found = _find(registry, args.pop("type"))
    get_instance = getattr(found, "get_instance", None) if inspect.isclass(found) else None
    if callable(get_instance):
        return get_instance(**args)
    return found(**args)


def build_model_from_cfg(cfg: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                         registry: Registry,
                         default_args: Mapping[str, Any] | None = None) -> Any:
    """``build_from_cfg``, or for a list of configs a ``torch.nn.Sequential`` of each built.

    Args:
        cfg: a model's config dict, or a list of them.
        registry: where names are looked up.
        default_args: keyword arguments for what each config does not give.

    Returns:
        The model.
    """
    if isinstance(cfg, list):
        return torch.nn.Sequential(*(build_from_cfg(c, registry, default_args) for c in cfg))
    return build_from_cfg(cfg, registry, default_args)  # type: ignore[arg-type]


def build_runner_from_cfg(cfg: Mapping[str, Any], registry: Registry) -> Any:
    """A runner built by ``from_cfg(cfg)`` of the class ``cfg['runner_type']`` names.

    Args:
        cfg: the whole config; its ``runner_type`` (default ``'Runner'``) is a name in
            ``registry`` or a runner class.
        registry: where names are looked up.

    Returns:
        The runner.
    """
    if not isinstance(cfg, Mapping):
        raise TypeError(f"building a runner: cfg must be a dict or Config; got "
                        f"{type(cfg).__name__}")
    args = cfg.copy() if hasattr(cfg, "copy") else dict(cfg)
    if "_scope_" in args:
        del args["_scope_"]
    runner_cls = _find(registry, args.get("runner_type", "Runner"))
    return runner_cls.from_cfg(args)


def build_scheduler_from_cfg(cfg: Mapping[str, Any], registry: Registry,
                             default_args: Mapping[str, Any] | None = None) -> Any:
    """A parameter scheduler: ``build_from_cfg``, or, for a config with
    ``convert_to_iter_based=True``, the class's ``build_iter_from_epoch`` (an epoch-based
    schedule stepped every iteration; ``default_args`` must then hold ``epoch_length``).

    Args:
        cfg: the scheduler's config dict.
        registry: where names are looked up.
        default_args: keyword arguments for what ``cfg`` does not give (the optimiser).

    Returns:
        The scheduler.

    Raises:
        ValueError: ``convert_to_iter_based`` without ``epoch_length``, or with
            ``by_epoch=False``.
    """
    args = _merged_args(cfg, default_args, "building a parameter scheduler")
    if not args.pop("convert_to_iter_based", False):
        args.pop("epoch_length", None)
        return build_from_cfg(args, registry)
    if "epoch_length" not in args or not args.get("by_epoch", True):
        raise ValueError(f"parameter scheduler {args.get('type')!r}: convert_to_iter_based "
                         f"needs an epoch-based scheduler (by_epoch=True) and epoch_length")
    if "type" not in args:
        raise KeyError("building a parameter scheduler: the config has no 'type'")
    return _find(registry, args.pop("type")).build_iter_from_epoch(**args)


def _torch_optimizers() -> dict[str, type]:
    """torch.optim's optimiser classes by name."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) \
                and obj is not torch.optim.Optimizer:
            found[name] = obj
    return found


# The kinds trainrun has too share trainrun's registries: a class registered here is a name
# a trainrun config can give. Strategies and collate functions do not: trainrun's strategies
# ("ddp", "fsdp") wrap a model where MMEngine's run a whole training, and FUNCTIONS holds any
# function, not only collates.
MODELS = Registry("model", build_model_from_cfg, backend=trainrun_registry.MODELS)
DATASETS = Registry("dataset", backend=trainrun_registry.DATASETS)
METRICS = Registry("metric", backend=trainrun_registry.METRICS)
HOOKS = Registry("hook", backend=trainrun_registry.HOOKS)

RUNNERS = Registry("runner", build_runner_from_cfg, locations=["trainrun.compat.mmengine.runner"])
RUNNER_CONSTRUCTORS = Registry("runner constructor")
LOOPS = Registry("loop")
STRATEGIES = Registry("strategy")
DATA_SAMPLERS = Registry("data sampler")
TRANSFORMS = Registry("transform")
MODEL_WRAPPERS = Registry("model wrapper")
WEIGHT_INITIALIZERS = Registry("weight initializer")
OPTIMIZERS = Registry("optimizer")
OPTIM_WRAPPERS = Registry("optim wrapper", locations=["trainrun.compat.mmengine.optim"])
OPTIM_WRAPPER_CONSTRUCTORS = Registry("optim wrapper constructor")
PARAM_SCHEDULERS = Registry("parameter scheduler", build_scheduler_from_cfg,
                            locations=["trainrun.compat.mmengine.optim"])
EVALUATOR = Registry("evaluator")
TASK_UTILS = Registry("task util")
VISUALIZERS = Registry("visualizer")
VISBACKENDS = Registry("vis backend")
LOG_PROCESSORS = Registry("log processor")
INFERENCERS = Registry("inferencer")
FUNCTIONS = Registry("function")

for _name, _optimizer in _torch_optimizers().items():
    OPTIMIZERS.register_module(name=_name, module=_optimizer)
for _name in ("default_collate", "pseudo_collate"):
    FUNCTIONS.backend.register(_name, f"trainrun.compat.mmengine.dataset:{_name}")
del _name, _optimizer

__all__ = ["DATASETS", "DATA_SAMPLERS", "EVALUATOR", "FUNCTIONS", "HOOKS", "INFERENCERS",
           "LOG_PROCESSORS", "LOOPS", "METRICS", "MODELS", "MODEL_WRAPPERS", "OPTIMIZERS",
           "OPTIM_WRAPPERS", "OPTIM_WRAPPER_CONSTRUCTORS", "PARAM_SCHEDULERS", "RUNNERS",
           "RUNNER_CONSTRUCTORS", "Registry", "STRATEGIES", "TASK_UTILS", "TRANSFORMS",
           "VISBACKENDS", "VISUALIZERS", "WEIGHT_INITIALIZERS", "build_from_cfg",
           "build_model_from_cfg", "build_runner_from_cfg", "build_scheduler_from_cfg"]
