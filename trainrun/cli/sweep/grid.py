"""The grid and its points: ``--grid KEY=V1,V2`` read as YAML values (as --cfg-options reads
them), their product as named points, and the ``trainrun train`` arguments of a point."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainrun.messages import show

# keys the sweep sets itself for every point
RESERVED = ("name", "work_dir", "launcher", "resume")


class SweepError(ValueError):
    """A command line or grid the sweep cannot run; the message is one line naming it."""


@dataclass(frozen=True)
class Point:
    """One grid point: its place, name, run directory and the overrides that make it."""

    index: int
    name: str
    work_dir: Path
    values: dict[str, str]  # dotted key -> the value as shown (YAML's reading: 1e-3 is 0.001)
    overrides: list[str]  # key=value for --cfg-options, name=<point name> last
    label: str  # "lr=0.001 hidden=64"


@dataclass
class Sweep:
    """A validated sweep: the config, the grid, its points and where they go."""

    config: Path
    cfg_options: list[str]
    grid: dict[str, list[str]]  # dotted key -> values as shown
    name: str
    directory: Path
    points: list[Point]
    launcher: str  # local | slurm
    nproc: int | None

    def identity(self) -> dict[str, Any]:
        """What a rerun into the same directory must repeat: the points depend on it."""
        return {"config": str(self.config.resolve()), "cfg_options": self.cfg_options,
                "grid": self.grid}


def split_values(text: str) -> list[str]:
    """``text`` split at its commas, but not inside [...], {...} or quotes (YAML lists)."""
    values, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


def shown(value: Any) -> str:
    """A grid value as names, tables and comparisons show it."""
    if value is None or isinstance(value, bool):
        return show(value)
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back the same: 1e-3 -> 0.001
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def typed_value(key: str, text: str) -> Any:
    """``text`` read the way --cfg-options reads a value (YAML, through OmegaConf)."""
    from omegaconf import OmegaConf

    from trainrun.runner.config import ConfigError, parse_override

    try:
        value: Any = OmegaConf.to_container(parse_override(f"{key}={text}"), resolve=False)
    except ConfigError as error:
        raise SweepError(f"--grid {key}: {error}") from None
    for part in key.split("."):
        value = value[part]
    return value


def parse_grid(items: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``KEY=V1,V2`` items as {key: values as shown} and {key: values as written}."""
    shown_values: dict[str, list[str]] = {}
    written: dict[str, list[str]] = {}
    for item in items:
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or not key or not all(key.split(".")):
            raise SweepError(f"--grid {item!r}: expected KEY=V1,V2,... with a dotted key, "
                             f"e.g. optim.lr=1e-3,3e-3")
        if key in written:
            raise SweepError(f"--grid {key}: given twice; give all its values once, "
                             f"comma-separated")
        if key in RESERVED:
            raise SweepError(f"--grid {key}: the sweep sets {key} for every point itself")
        values = split_values(text)
        if "" in values:
            raise SweepError(f"--grid {key}: got {text!r}, which has an empty value")
        labels = [shown(typed_value(key, value)) for value in values]
        for label in labels:
            if labels.count(label) > 1:
                raise SweepError(f"--grid {key}: the value {label} is given twice")
        shown_values[key], written[key] = labels, values
    return shown_values, written


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each key's last dotted part, or as many last parts as set it apart from the others."""
    out: dict[str, str] = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if not any(other != key and (other == short or other.endswith("." + short))
                       for other in keys):
                break
        out[key] = short
    return out


def file_safe(text: str) -> str:
    """``text`` with every run of characters a file name should not hold replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "_"


def make_points(name: str, directory: Path, grid: dict[str, list[str]],
                written: dict[str, list[str]]) -> list[Point]:
    """The grid's points in order, each named after its values."""
    shorts = short_keys(list(grid))
    points: list[Point] = []
    by_name: dict[str, str] = {}
    combos = zip(itertools.product(*grid.values()), itertools.product(*written.values()),
                 strict=True)
    for index, (labels, texts) in enumerate(combos):
        values = dict(zip(grid, labels, strict=True))
        label = " ".join(f"{shorts[k]}={v}" for k, v in values.items())
        point_name = file_safe(name) + "".join(
            f"-{file_safe(shorts[k])}={file_safe(v)}" for k, v in values.items())
        if point_name in by_name:
            raise SweepError(f"--grid: the points {by_name[point_name]} and {label} would both "
                             f"be named {point_name!r}; their values differ only in characters "
                             f"a file name cannot hold")
        by_name[point_name] = label
        overrides = [*(f"{k}={t}" for k, t in zip(grid, texts, strict=True)),
                     f"name={point_name}"]
        points.append(Point(index, point_name, directory / point_name, values, overrides, label))
    return points


def point_launcher(launcher: str, nproc: int | None) -> str:
    """What each point's ``trainrun train`` is told: none, pytorch (torchrun) or slurm (srun)."""
    if launcher == "slurm":
        return "slurm"
    return "none" if nproc is None else "pytorch"


def train_args(config: Path | str, cfg_options: Sequence[str], overrides: Sequence[str],
               work_dir: Path | str, launcher: str) -> list[str]:
    """``trainrun train``'s arguments for a point: always --resume (from the start when there is
    no checkpoint yet), the point's overrides after the sweep's."""
    return [str(config), "--launcher", launcher, "--work-dir", str(work_dir), "--resume",
            "--cfg-options", *cfg_options, *overrides]
