"""A sweep's summary: one row per point (its grid values, state, last step, final losses,
final and best validation metrics) as ``summary.csv``, ``summary.md`` and the bars of
``summary.png``."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainrun.checkpoint.files import replacing, write_atomically
from trainrun.cli.metrics import Series, read_run
from trainrun.cli.sweep.grid import Sweep
from trainrun.cli.sweep.slurm import active_tasks
from trainrun.cli.sweep.status import point_state, say


def read_point(work_dir: Path) -> tuple[Series, Series]:
    """A point's training and validation series, one value per step. A resume takes the lines
    of the steps it trains again out of metrics.jsonl; in a file written before it did, where
    an attempt was cut short and a resumed one logged the same step again, the later line
    counts."""
    try:
        train, val = read_run(work_dir)
    except ValueError:  # no metrics.jsonl, or nothing in it yet
        return {}, {}
    return ({k: sorted(dict(v).items()) for k, v in train.items()},
            {k: sorted(dict(v).items()) for k, v in val.items()})


def lower_is_better(metric: str) -> bool:
    """A loss is better lower, anything else higher: the rule of checkpoint.save_best."""
    from trainrun.runner.hooks.checkpoint import best_rule_for

    return best_rule_for(metric) == "less"


def best(points: list[tuple[int, float]], metric: str) -> tuple[float, int]:
    """The best value of a series and its step (the earliest on a tie)."""
    sign = 1 if lower_is_better(metric) else -1
    step, value = min(points, key=lambda step_value: (sign * step_value[1], step_value[0]))
    return value, step


def point_numbers(train: Series, val: Series) -> dict[str, float | int]:
    """A point's summary numbers: last step, final losses, final and best validation metrics
    (with the step of the best)."""
    numbers: dict[str, float | int] = {}
    if train:
        numbers["step"] = max(step for series in train.values() for step, _ in series)
    for key in (k for k in train if "loss" in k):
        numbers[f"final_{key}"] = train[key][-1][1]
    for metric, series in val.items():
        value, step = best(series, metric)
        numbers.update({f"final_{metric}": series[-1][1], f"best_{metric}": value,
                        f"best_{metric}_step": step})
    return numbers


@dataclass
class Table:
    """The summary: a header, and one row per point (cells as values, None where missing)."""

    header: list[str]
    rows: list[list[Any]]


def summary_table(sweep: Sweep, active: dict[int, str]) -> Table:
    """One row per point: its grid values, state and numbers."""
    numbers = [point_numbers(*read_point(point.work_dir)) for point in sweep.points]
    columns: list[str] = []
    for row in numbers:
        columns += [name for name in row if name not in columns]
    header = ["point", *sweep.grid, "status", *columns]
    rows = [[p.name, *p.values.values(), point_state(p, active), *(n.get(c) for c in columns)]
            for p, n in zip(sweep.points, numbers, strict=True)]
    return Table(header, rows)


def csv_text(table: Table) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.header)
    writer.writerows([["" if cell is None else cell for cell in row] for row in table.rows])
    return out.getvalue()


def markdown_cell(cell: Any) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, float):
        return f"{cell:.4g}"
    return str(cell).replace("|", "\\|")


def markdown_text(sweep: Sweep, table: Table) -> str:
    """A title line, then the table with numbers to 4 significant digits."""
    header = [h for h in table.header if h != "point"]
    lines = [f"# Sweep {sweep.name}: {len(sweep.points)} points", "",
             f"config `{sweep.config}`, grid " + ", ".join(
                 f"`{k}` = {', '.join(v)}" for k, v in sweep.grid.items()), "",
             "| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if h.startswith(("final", "best", "step")) else "---"
                            for h in header) + "|"]
    for row in table.rows:
        lines.append("| " + " | ".join(markdown_cell(c) for c in row[1:]) + " |")
    return "\n".join(lines) + "\n"


Quantity = tuple[str, list[Any], bool]  # title, one value per point, lower is better


def bar_quantities(table: Table) -> list[Quantity]:
    """What the bars compare: every final loss, then the best value of every metric."""
    out = []
    for i, name in enumerate(table.header):
        if name.startswith("final_loss") or (name.startswith("best_")
                                              and not name.endswith("_step")):
            lower = lower_is_better(name)
            title = f"{name.replace('_', ' ', 1)} ({'lower' if lower else 'higher'} is better)"
            out.append((title, [row[i] for row in table.rows], lower))
    return out


def plot_bars(path: Path, labels: list[str], quantities: list[Quantity]) -> None:
    """One panel of horizontal bars per quantity, one bar per point, the best one orange."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(quantities), sharey=True, squeeze=False,
                                figsize=(1.8 + 4.2 * len(quantities), 1.6 + 0.45 * len(labels)))
    for axis, (title, values, lower) in zip(axes[0], quantities, strict=True):
        known = [v for v in values if v is not None]
        top = (min if lower else max)(known)
        bars = axis.barh(range(len(labels)), [0 if v is None else v for v in values],
                         color=["tab:orange" if v == top else "tab:blue" for v in values])
        axis.bar_label(bars, labels=["n/a" if v is None else f"{v:.4g}" for v in values],
                       padding=3, fontsize="small")
        axis.set_title(title)
        axis.margins(x=0.25)
        axis.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(labels)), labels)
    axes[0][0].invert_yaxis()  # the first point on top
    figure.tight_layout()
    try:
        with replacing(path) as tmp:  # the format follows the suffix, which tmp keeps
            figure.savefig(tmp, dpi=110)
    finally:  # a failed write must not keep the figure open
        plt.close(figure)


def write_summary(sweep: Sweep) -> Table:
    """summary.csv, summary.md and summary.png (once a point has logged numbers)."""
    table = summary_table(sweep, active_tasks(sweep.directory))
    write_atomically(sweep.directory / "summary.csv", csv_text(table))
    write_atomically(sweep.directory / "summary.md", markdown_text(sweep, table))
    quantities = [q for q in bar_quantities(table) if any(v is not None for v in q[1])]
    if quantities:
        plot_bars(sweep.directory / "summary.png", [p.label for p in sweep.points], quantities)
    say(f"summary: {sweep.directory / 'summary.md'} (and summary.csv"
        + (", summary.png)" if quantities else "; nothing logged yet to plot)"))
    return table
