"""The config's ``hooks:`` list: hooks of yours (or shipped ones) by name, with options.

.. code-block:: yaml

    hooks:
      - {type: EarlyStopping, metric: accuracy, patience: 3}
      - {type: my_project.hooks.GradNorm, priority: before_checkpoint, every: 10}

``type`` is a shipped hook's name (``trainrun.registry.HOOKS``) or an import path, as for
``model.type``; ``priority`` (optional) is an int or ``before_<slot>`` / ``after_<slot>`` for
a built-in slot of `hooks.base` (timer, logger, validation, normal, checkpoint, preemption),
and wins over the class's own; the other keys are the hook's options. All of it is checked
with the config (an option the class does not take, a value its table refuses), the rest when
the run is built, before anything is written: the constructor's ValueError, and what
`Hook.check` finds (the dry run builds the hooks too, and checks them against what the config
says of the run: ``trainrun.runner.plan.check_planned_hooks``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

from trainrun.messages import first_line, is_int
from trainrun.registry import resolve
from trainrun.runner.hooks.base import SLOTS, Hook
from trainrun.runner.schema import (
    OPTIONAL,
    REQUIRED,
    ConfigError,
    bad_value,
    expects,
    fields,
)

PRIORITY_NAMES = tuple(f"{where}_{slot}" for slot in SLOTS for where in ("before", "after"))


def priority(key: str, value: Any) -> int | str:
    """An int, or ``before_<slot>`` / ``after_<slot>`` (see `priority_value`)."""
    if is_int(value) or (isinstance(value, str) and value in PRIORITY_NAMES):
        return value
    raise bad_value(key, value, f"an int or one of {', '.join(PRIORITY_NAMES)}")


priority.expected = "an int or a name such as before_checkpoint"  # type: ignore[attr-defined]


def priority_value(value: int | str) -> int:
    """The number of a checked ``priority``: ``before_X`` runs just before the built-in slot
    X, ``after_X`` just after it (ties keep the order of the list: built-in hooks first, then
    the config's)."""
    if is_int(value):
        return int(value)
    where, _, slot = str(value).partition("_")
    return SLOTS[slot] + (-1 if where == "before" else 1)


def _type_name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad_value(key, value, "a shipped hook's name or an import path")
    return value


ITEM = {
    "type": (REQUIRED, expects("a shipped hook's name or an import path", _type_name),
             "EMA, EarlyStopping, Profiler, or a Hook subclass by import path"),
    "priority": (OPTIONAL, priority,
                 "when the hook runs among the others (default: the class's own, normal = 50)"),
}


def hook_class(key: str, name: str) -> type[Hook]:
    """The class ``name`` stands for: a shipped hook or an import path, a `Hook` subclass."""
    try:
        found = resolve("hook", name)
    except ValueError as error:
        raise ConfigError(f"{key}.type: {error}") from None
    if not (isinstance(found, type) and issubclass(found, Hook)):
        raise bad_value(f"{key}.type", name, "a subclass of trainrun.runner.hooks.Hook")
    return found


def check_hook(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    """One item of ``hooks``: its type found, its priority and options checked."""
    if not isinstance(value, Mapping):
        raise bad_value(key, value, "a mapping with a 'type' (a hook's name or import path)")
    out = fields(key, value, ITEM, open_=True)
    cls = hook_class(key, out["type"])
    options = {k: v for k, v in out.items() if k not in ITEM}
    head = {k: out[k] for k in ITEM if k in out}
    return {**head, **cls.check_options(key, options, warnings)}


def check_hooks(key: str, value: Any, warnings: list[str]) -> list[dict[str, Any]]:
    """The ``hooks`` list (null: none)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_value(key, value, "a list of hooks, each a mapping such as "
                                    "{type: EarlyStopping, metric: accuracy}")
    return [check_hook(f"{key}[{i}]", item, warnings) for i, item in enumerate(value)]


check_hooks.expected = "a list of hooks"  # type: ignore[attr-defined]


def option_names(cls: type) -> list[str]:
    """The names of a hook class's options: its table's, else its constructor's."""
    table = getattr(cls, "OPTIONS", None)
    return list(table) if isinstance(table, Mapping) else \
        list(inspect.signature(cls).parameters)


def hook_error(key: str, error: Exception, options: Sequence[str]) -> ConfigError:
    """A hook's ValueError as a ConfigError naming ``key``, and its option where the message
    begins with one (``patience: ...``)."""
    message = first_line(error)
    found = re.match(r"^(\w+): ", message)
    if found and found.group(1) in options:
        return ConfigError(f"{key}.{message}")
    return ConfigError(f"{key}: {message}")


def build_hook(key: str, item: Mapping[str, Any], warnings: list[str]) -> Hook:
    """The hook a ``hooks`` item describes, built; its ``priority`` set where given."""
    checked = check_hook(key, item, warnings)
    cls = hook_class(key, checked["type"])
    options = {k: v for k, v in checked.items() if k not in ITEM}
    try:
        hook = cls(**options)
    except ValueError as error:
        raise hook_error(key, error, option_names(cls)) from None
    if "priority" in checked:
        hook.priority = priority_value(checked["priority"])
    return hook


def check_built_hook(key: str, hook: Any, runner: Any) -> None:
    """``hook.check(runner)``, where the hook has one (it need not derive from `Hook`); its
    ValueError as a ConfigError naming the ``hooks`` item ``key`` (and its option where the
    message begins with one)."""
    check = getattr(hook, "check", None)
    try:
        if check is not None:
            check(runner)
    except ValueError as error:
        raise hook_error(key, error, option_names(type(hook))) from None


def planned_order(builtin: Sequence[tuple[str, int]],
                  items: Sequence[Mapping[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(priority, item without its priority) of every hook in the order they run: the
    ``builtin`` ones (name, priority) as ``{type: name}``, first at a tie, as the runner sorts
    them; then the config's ``items``."""
    rows = [(number, {"type": name}) for name, number in builtin]
    for item in items:
        number = priority_value(item["priority"]) if "priority" in item \
            else hook_class("hooks", item["type"]).priority
        rows.append((number, {k: v for k, v in item.items() if k != "priority"}))
    return sorted(rows, key=lambda row: row[0])
