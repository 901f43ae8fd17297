"""The test suite's own layout: no module of it uses a test module as a library.

What tests share lives in tests/conftest.py and in helper modules (tests/cli.py, tests/runs.py,
tests/records.py, tests/procs.py, ...). A test module imported by another one runs its
module-level code and defines its fixtures a second time under another module's name, and
ties the tests of one file to the helpers of another; so every Python file under tests/ is read
here (but this one, whose examples are such uses), and any use of a test module other than
itself fails the test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TEST_MODULE_NAME = re.compile(r"test_\w+")
# an import path from tests/, anywhere in a string ("model.type=tests.x.test_y.Model")
IMPORT_PATH = re.compile(r"(?<![\w./])tests\.[\w.:]+")
# the calls that import a module named by a string (or run a file)
IMPORT_CALLS = {"import_module", "__import__", "spec_from_file_location", "SourceFileLoader",
                "run_module", "run_path", "import_path"}


def _test_module(parts: list[str]) -> str | None:
    """The dotted name of the test module ``parts`` (an import path, split) lead to, if any:
    ``tests.x.test_y`` for ``tests.x.test_y.Thing``."""
    for index, part in enumerate(parts):
        if TEST_MODULE_NAME.fullmatch(part):
            return ".".join(parts[:index + 1])
    return None


def _split(text: str) -> list[str]:
    """``tests.x.test_y:Thing``, ``tests/x/test_y.py::test_z``: their parts, in order."""
    text = text.split("::")[0].removesuffix(".py")
    return [part for part in re.split(r"[./:]", text) if part]


def uses_of_test_modules(source: str, module: str) -> list[tuple[int, str]]:
    """Where the code ``source`` of the module named ``module`` (``tests.x.y``) uses a test
    module other than itself, and which: by an import statement (absolute or relative),
    through importlib and the like, or by an import path in a string (a config's ``type:``,
    which trainrun's registry imports)."""
    package = module.split(".")[:-1]
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_test_module(alias.name.split(".")) for alias in node.names
                       if alias.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = node.module.split(".") if node.module else []
            if parts[:1] == ["tests"]:
                targets = [_test_module(parts)] + [_test_module([*parts, alias.name])
                                                   for alias in node.names]
        elif isinstance(node, ast.Call) and (
                getattr(node.func, "attr", None) in IMPORT_CALLS
                or getattr(node.func, "id", None) in IMPORT_CALLS):
            for arg in ast.walk(node):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    parts = _split(arg.value)
                    if parts[:1] != ["tests"] and "/" not in arg.value:
                        parts = package + parts  # a name or a file beside this module
                    targets.append(_test_module(parts))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docstrings:  # (a docstring names files; it imports none)
            targets = [_test_module(_split(path)) for path in IMPORT_PATH.findall(node.value)]
        found += [(node.lineno, target) for target in targets
                  if target is not None and target != module]
    return sorted(set(found))


def test_no_module_of_the_suite_uses_another_test_module():
    files = sorted(path for path in TESTS.rglob("*.py") if path != Path(__file__).resolve())
    assert len([f for f in files if f.name.startswith("test_")]) > 50  # the suite was found
    used = []
    for path in files:
        module = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)
        used += [f"{path.relative_to(TESTS.parent)}:{line}: {target}"
                 for line, target in uses_of_test_modules(path.read_text(), module)]
    assert not used, ("test modules used as libraries (move what they share to "
                      "tests/conftest.py or a helper module):\n" + "\n".join(used))


# ways to use tests/tools/test_train_cli.py from tests/tools/test_here.py, by name
USES = {
    "from-import": "from tests.tools.test_train_cli import env\n",
    "from-package": "from tests.tools import test_train_cli\n",
    "import": "import tests.tools.test_train_cli as cli\n",
    "relative": "from .test_train_cli import env\n",
    "relative-package": "from . import test_train_cli\n",
    "relative-parent": "from ..tools.test_train_cli import env\n",
    "import_module": "import importlib\nimportlib.import_module('tests.tools.test_train_cli')\n",
    "__import__": "cli = __import__('tests.tools.test_train_cli')\n",
    "spec-from-path": "from importlib.util import spec_from_file_location\n"
                      "spec = spec_from_file_location('cli', 'tests/tools/test_train_cli.py')\n",
    "spec-beside": "spec = importlib.util.spec_from_file_location('cli', HERE / "
                   "'test_train_cli.py')\n",
    "config-type": "MODEL = {'type': 'tests.tools.test_train_cli.SomeModel'}\n",
    "cfg-option": "OPTION = 'model.type=tests.tools.test_train_cli.SomeModel'\n",
}
# what tests/tools/test_here.py may do
ALLOWED = {
    "helpers": "from tests.cli import env\nfrom tests.runner.toy import ToyModel\n",
    "relative-helper": "from . import models\nfrom .models import SlowDigitsMLP\n",
    "its-own-class": "MODEL = {'type': 'tests.tools.test_here.Mine'}\n",
    "a-helper-class": "OPTION = 'model.type=tests.tools.models.SlowDigitsMLP'\n",
    "find_spec": "import importlib.util\nfound = importlib.util.find_spec('mlflow')\n",
    "test-names": "from trainrun.cli import test as test_tool\nNAME = 'test_loss'\n",
    "docstring": '"""Like tests/tools/test_train_cli.py, and tests.tools.test_train_cli."""\n',
}


@pytest.mark.parametrize("source", USES.values(), ids=USES.keys())
def test_every_way_to_use_another_test_module_is_found(source):
    assert [target for _, target in uses_of_test_modules(source, "tests.tools.test_here")] == [
        "tests.tools.test_train_cli"], source


@pytest.mark.parametrize("source", ALLOWED.values(), ids=ALLOWED.keys())
def test_helpers_and_the_module_itself_are_allowed(source):
    assert uses_of_test_modules(source, "tests.tools.test_here") == [], source
