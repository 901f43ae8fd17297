"""``{command-help} train``: a subcommand's ``--help`` as it prints now, when the site is built.

The command line page shows each subcommand's help through this, so a renamed flag changes
the page with the code instead of leaving a copy behind.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def command_help(subcommand: str) -> str:
    """What ``trainrun SUBCOMMAND --help`` prints on an 80-column terminal."""
    from trainrun import cli

    out = io.StringIO()
    argv, columns = sys.argv, os.environ.get("COLUMNS")
    sys.argv, os.environ["COLUMNS"] = ["trainrun"], "80"
    try:
        with contextlib.redirect_stdout(out):
            code = cli.main([*subcommand.split(), "--help"])
    finally:
        sys.argv = argv
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    if code != 0:
        raise ValueError(f"trainrun {subcommand} --help exited with {code}")
    return out.getvalue().rstrip("\n")


class CommandHelp(SphinxDirective):
    required_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        text = command_help(self.arguments[0])
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("command-help", CommandHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
