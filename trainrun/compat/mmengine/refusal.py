"""What every translation of MMEngine's arguments into trainrun's uses: the name a config's
``type`` stands for, and the one-line refusal of what trainrun cannot honour."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainrun.runner.schema import ConfigError


def refused(key: str, value: Any, why: str = "") -> ConfigError:
    """The one-line refusal of an argument or option trainrun cannot honour."""
    return ConfigError(f"{key}={value!r}: not supported by trainrun.compat.mmengine"
                       + (f"; {why}" if why else ""))


def type_name(value: Any) -> str:
    """A config's ``type``: a string as it is, a class or function by its name."""
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))


def only(key: str, section: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuse the first key of ``section`` that is not in ``allowed``."""
    for name in section:
        if name not in allowed:
            raise refused(f"{key}.{name}", section[name],
                          f"{key} takes {', '.join(sorted(allowed))}")
