"""Plot the loss and metric curves of one or several runs into one PNG.

    python tools/plot_metrics.py RUN_DIR [RUN_DIR ...] -o curves.png [--keys loss accuracy]

Each RUN_DIR is a work_dir holding ``metrics.jsonl``. One panel per quantity: the training
loss (and any other logged training value asked for with ``--keys``), then every validation
metric; each run is one line in every panel, named after its directory. Exit code 2 for a
missing or empty run directory.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from trainrun.checkpoint.files import replacing
from trainrun.cli.metrics import Series, read_run
from trainrun.exits import EXIT_OK, EXIT_USAGE


def panels(runs: dict[str, tuple[Series, Series]], keys: list[str] | None) -> list[str]:
    """Panel titles in order: training keys (loss first), then validation metrics."""
    train_keys: list[str] = []
    val_keys: list[str] = []
    for train, val in runs.values():
        train_keys += [k for k in train if k not in train_keys]
        val_keys += [k for k in val if k not in val_keys]
    wanted = keys or ["loss"]
    titles = [f"train {k}" for k in wanted if k in train_keys]
    return titles + [f"val {k}" for k in val_keys if not keys or k in keys]


def plot(runs: dict[str, tuple[Series, Series]], titles: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    columns = min(len(titles), 3)
    rows = math.ceil(len(titles) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis, title in zip(axes.flat, titles, strict=False):
        split, key = title.split(" ", 1)
        for name, (train, val) in runs.items():
            points = (train if split == "train" else val).get(key)
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(steps, values, label=name, marker="o" if split == "val" else None,
                          markersize=3)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(titles):]:
        axis.set_visible(False)
    figure.tight_layout()
    try:
        with replacing(out) as tmp:  # a cut file never replaces a good one
            figure.savefig(tmp, dpi=110)  # (the format follows the suffix, which tmp keeps)
    finally:  # a failed write must not keep the figure open
        plt.close(figure)


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name; the full path where two names collide."""
    names = [d.resolve().name for d in run_dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(run_dirs, names, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"),
                        help="the PNG to write (default curves.png)")
    parser.add_argument("--keys", nargs="+", help="only these values (default: the training "
                        "loss and every validation metric)")
    args = parser.parse_args(argv)
    try:
        names = run_names(args.run_dirs)
        runs = {name: read_run(d) for name, d in zip(names, args.run_dirs, strict=True)}
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    titles = panels(runs, args.keys)
    if not titles:
        print(f"error: --keys: none of {args.keys} was logged by these runs", file=sys.stderr)
        return EXIT_USAGE
    plot(runs, titles, args.output)
    print(f"wrote {args.output} ({len(titles)} panels, {len(runs)} runs)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
