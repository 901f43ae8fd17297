"""The config's schema language: each section is a table of keys, defaults and checks.

A check is a function ``(dotted key, value) -> value`` that returns the value normalised or
raises `ConfigError`, one line naming the key, the value and what was expected (with "did you
mean" where a near name exists). Each section's table lives beside the code that uses the
section (`seed.py`, `builder.py`, `optim/section.py`, ...); `config.py` puts them together.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from trainrun.messages import closest, is_int, is_number, show

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
# key -> (default or REQUIRED or OPTIONAL, check, one line of meaning for the config reference);
# a table used only inside a check may leave the meaning out: (default, check)
Fields = dict[str, tuple[Any, ...]]


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


def call_mismatch(target: Callable[..., Any], /, *args: Any, **options: Any) -> str | None:
    """Why ``target(*args, **options)`` would be refused for its arguments (TypeError's words),
    or None where they bind to its signature, or it has none to read (a builtin: the call
    itself will tell). Config sections that name a class or function check their options
    with it before anything is built (an option may be called ``target`` too)."""
    try:
        inspect.signature(target).bind(*args, **options)
    except TypeError as error:
        return str(error)
    except ValueError:
        return None
    return None


# ---------------------------------------------------------------- value checks

def expected_of(check: Check) -> str:
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


check_bool = rule("true or false", lambda v: isinstance(v, bool))
check_text = rule("a non-empty string", lambda v: isinstance(v, str) and v.strip() != "")


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
            raise bad_value(key, value, f"null or {expected_of(check)}") from None
    return expects(f"null or {expected_of(check)}", nullable_check)


def names(item: Check) -> Check:
    """A list whose every item passes ``item`` (named by index on error); duplicates dropped."""
    expected = f"a list of {expected_of(item)}"

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
    for name, (default, check, *_) in table.items():
        if name in value:
            out[name] = check(join(key, name), value[name])
        elif default is REQUIRED:
            raise ConfigError(f"{join(key, name)}: missing, expected {expected_of(check)}")
        elif default is not OPTIONAL:
            out[name] = check(join(key, name), default)
    out.update((name, v) for name, v in value.items() if name not in table)
    return out


def section(table: Fields, *, open_: bool = False) -> Check:
    return expects("a mapping", partial(fields, table=table, open_=open_))

