"""The core registry: one module for every kind of name, filled by the modules that own the
names, and loaded only when a name is looked up."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from trainrun.registry import REGISTRIES, STRATEGIES, resolve

REPO = Path(__file__).resolve().parents[1]


def test_every_kind_of_name_has_a_registry_in_the_core():
    assert set(REGISTRIES) == {"model", "dataset", "metric", "hook", "collate", "tracker",
                               "strategy", "checkpoint format"}


def test_importing_the_registry_imports_no_registered_module():
    code = ("import sys, trainrun.registry; "
            "print(sorted(m for m in sys.modules if m.startswith('trainrun')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert eval(out) == ["trainrun", "trainrun.messages", "trainrun.registry"]


def test_the_examples_only_register_names():
    tree = ast.parse((REPO / "trainrun" / "examples" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom):
            assert node.module == "trainrun.registry"
            continue
        assert isinstance(node, ast.Expr) and node.value.func.attr == "register", \
            ast.unparse(node)


def test_a_registry_loads_its_locations_at_the_first_lookup_and_imports_targets_lazily():
    code = """if True:
        import sys
        from trainrun.registry import METRICS, MODELS
        assert "trainrun.examples" not in sys.modules
        assert "DigitsMLP" in MODELS
        assert "trainrun.examples" in sys.modules
        assert "trainrun.examples.digits" not in sys.modules
        assert MODELS.target("DigitsMLP") == "trainrun.examples.digits:DigitsMLP"
        assert MODELS["DigitsMLP"].__name__ == "DigitsMLP"
        assert "trainrun.examples.digits" in sys.modules
        assert METRICS["val_loss"]().name == "val_loss"  # a name with default options
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_name_registered_at_run_time_is_found_and_removed():
    class Mine:
        pass

    STRATEGIES["mine"] = Mine
    try:
        assert STRATEGIES["mine"] is Mine and "mine" in list(STRATEGIES)
    finally:
        del STRATEGIES["mine"]
    assert "mine" not in STRATEGIES


def test_an_unknown_name_says_the_kind_a_close_name_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown strategy type 'fdsp'; did you mean 'fsdp'\?"
                                         r" Registered strategys: .*ddp.*fsdp"):
        resolve("strategy", "fdsp")
    with pytest.raises(ValueError, match="unknown registry kind 'gadget'"):
        resolve("gadget", "x")
