"""The command lines: ``trainrun SUBCOMMAND ...`` (the console script), ``python -m trainrun
SUBCOMMAND ...``, and the ``tools/*.py`` scripts, each of which runs one subcommand.

Each subcommand is a module here with a ``main(argv) -> exit code``; the runner's core
(`trainrun.runner`) knows nothing of command lines. Every ``main`` first puts the working
directory on sys.path (`import_from_working_directory`), so that however trainrun is started,
a config's ``type:`` paths are imported from the working directory and PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# what follows the Python interpreter (or torchrun's options) to train with the installed
# package: ``python -m trainrun train ARGS`` (tools that start training use it, so they work
# without a checkout of the repository)
TRAIN = ("-m", "trainrun", "train")

# subcommand -> (module under trainrun.cli, what it does)
COMMANDS = {
    "train": ("train", "train from a YAML config"),
    "plan": ("plan", "check a config and print what train would do (train --dry-run)"),
    "test": ("test", "test a checkpoint on the config's test data"),
    "sweep": ("sweep", "train every point of a hyper-parameter grid and summarise them"),
    "export": ("export", "consolidate a checkpoint into one plain state-dict file"),
    "verify-resume": ("verify_resume", "check that a config resumes bit for bit"),
}


def import_from_working_directory() -> None:
    """Put the working directory first on sys.path, as ``python -m`` does.

    The ``trainrun`` console script and the ``tools/*.py`` scripts would otherwise import
    from their own directory, and a researcher's ``my_model.Net`` beside their config would
    not be found; with this, one rule holds under every way of starting trainrun (torchrun's
    workers inherit the working directory): ``type:`` paths are imported from the working
    directory and PYTHONPATH.
    """
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: nothing to import from it
        return
    if sys.path[:1] not in ([cwd], [""]):  # "" is the working directory (python -c)
        sys.path.insert(0, cwd)


def prog(command: str, script: str) -> str:
    """The name a usage line gives: ``trainrun COMMAND`` in a process started as ``trainrun``
    or ``python -m trainrun``, else the tools/ script's (``train.py``)."""
    started = os.path.basename(sys.argv[0])
    return f"trainrun {command}" if started in ("trainrun", "__main__.py") else script


def usage() -> str:
    """``trainrun --help``: the subcommands, two examples and the page that says more."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: trainrun SUBCOMMAND [ARGS ...]   (trainrun SUBCOMMAND --help for its own)\n"
            "\nsubcommands:\n" + "\n".join(lines) + "\n\n" + epilog(
                "trainrun train configs/digits_single.yaml",
                "trainrun train configs/digits_ddp.yaml --nproc 2",
                docs="getting-started"))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The subcommands' help: description and epilog as written (the examples keep their
    lines), options' help from column 26, and a list option shown as ``K=V ...``, so that
    each option takes one line of an 80-column terminal."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=26)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if action.nargs == argparse.ONE_OR_MORE:
            return f"{self._metavar_formatter(action, default_metavar)(1)[0]} ..."
        return super()._format_args(action, default_metavar)


def epilog(*examples: str, docs: str) -> str:
    """A help text's ending: example command lines, and the docs page that says more
    (``docs/<docs>.md``); an argparse epilog for `HelpFormatter`."""
    return ("examples:\n" + "".join(f"  {example}\n" for example in examples)
            + f"\ndocs: docs/{docs}.md")


def main(argv: Sequence[str] | None = None) -> int:
    """``trainrun SUBCOMMAND ARGS``: run the subcommand's ``main(ARGS)``; returns its exit
    code (2 for an unknown subcommand: trainrun.exits' EXIT_USAGE, written out because importing
    trainrun.dist imports torch, which a usage line should not wait for)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: unknown subcommand {name!r}; expected one of {', '.join(COMMANDS)}\n"
              f"{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"trainrun.cli.{COMMANDS[name][0]}")
    return module.main(rest)
