"""Sphinx configuration of trainrun's documentation site (``make docs`` builds it into site/).

Pages are MyST Markdown; the API reference is rendered from the docstrings (autodoc with
napoleon, Google style); the config reference is generated from the config's schema tables
by ``_ext/config_reference.py``, and the command line's help by ``_ext/command_help.py``, so
none of them can drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # trainrun itself, when it is not installed

project = "trainrun"
author = "the trainrun developers"
copyright = "2026, the trainrun developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "config_reference",
    "command_help",
]

source_suffix = {".md": "markdown"}
# "--resume" stays two hyphens, and quotes stay as typed: readers copy flags from the text
smartquotes = False
root_doc = "index"
exclude_patterns = ["_build", "_generated", "_ext", "README.md"]

# MyST: heading anchors so that [text](page.md#a-heading) links are checked, and ::: fences
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# the API reference: Google-style docstrings, types shown with the arguments they describe
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
# a name between single backticks in a docstring is code, as in the Markdown pages (docutils'
# default would set it in italics as the title of a work)
default_role = "literal"

# -n (nitpicky) checks every cross-reference; names from other projects have no inventory
# here (the build must work offline), so they are not references to check.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|omegaconf|deepspeed|transformers|collections|typing|"
               r"datetime|pathlib|os|concurrent|threading|logging|enum|abc|types|"
               r"collections\.abc|contextlib|functools|argparse|subprocess|signal)\..*"),
    (r"py:class", r"(Tensor|Module|Optimizer|DataLoader|Dataset|ProcessGroup|Path|timedelta|"
                  r"DictConfig|Work|Store|ReduceOp|Callable|Iterator|Iterable|Mapping|"
                  r"Sequence|Any|TypeVar|T|Self|ellipsis|NoneType|PathLike|Generator|"
                  r"MutableMapping|ContextManager|AbstractContextManager)"),
    # a type variable, and a class the API hands out but does not export
    (r"py:.*", r"(nn|re|pickle)\..*"),
    (r"py:class", r"trainrun\.dist\.info\.F|trainrun\.dist\.heartbeat\.Heartbeat"),
]

html_theme = "furo"
html_title = "trainrun"
html_theme_options = {"navigation_with_keys": True}
html_show_sourcelink = False
