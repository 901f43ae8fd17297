"""The config's ``compile`` key: its values, its one-line errors, and the strategies that
honour it; `compile_module` keeping the model's keys and naming the module that fails.
(Compiled training itself: tests/wrappers/test_compile.py and tests/tools/test_compile_cli.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tools.models import ItemDigitsMLP
from trainrun.examples.digits import DigitsMLP
from trainrun.runner import Runner
from trainrun.runner.config import ConfigError, check_compile, load_config
from trainrun.wrappers import STRATEGIES, DDPStrategy
from trainrun.wrappers.base import COMPILE_DEFAULTS, CompileFailed, compile_module

CONFIG = """\
model: {type: digits_mlp}
data:
  train: {type: digits, batch_size: 16}
strategy: {type: ddp}
"""


def _load(tmp_path: Path, *overrides: str):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return load_config(path, list(overrides))


@pytest.mark.parametrize(("value", "expected"), [
    (False, False), (None, False), (True, COMPILE_DEFAULTS),
    ({"mode": "max-autotune"}, {**COMPILE_DEFAULTS, "mode": "max-autotune"}),
    ({"backend": "aot_eager", "fullgraph": True, "dynamic": False},
     {"backend": "aot_eager", "mode": "default", "fullgraph": True, "dynamic": False}),
])
def test_false_true_or_options_with_the_defaults_filled(value, expected):
    assert check_compile("compile", value) == expected


def test_off_by_default_and_saved_in_full_when_on(tmp_path):
    assert _load(tmp_path).compile is False
    on = _load(tmp_path, "compile=true")
    assert dict(on.compile) == {"backend": "inductor", "mode": "default", "fullgraph": False,
                                "dynamic": None}


@pytest.mark.parametrize(("override", "message"), [
    ("compile=3", "compile: got 3, expected false, true or a mapping of backend, mode, "
                  "fullgraph and dynamic"),
    ("compile=fast", "compile: got 'fast', expected false, true or a mapping"),
    ("compile.mode=fast", "compile.mode: got 'fast', expected one of default, reduce-overhead, "
                          "max-autotune, max-autotune-no-cudagraphs"),
    ("compile.mode=max_autotune", "did you mean 'max-autotune'?"),
    ("compile.backend=aot_eagr", "compile.backend: got 'aot_eagr', expected one of inductor, "
                                 "aot_eager, eager; did you mean 'aot_eager'?"),
    ("compile.fullgraph=1", "compile.fullgraph: got 1, expected true or false"),
    ("compile.dynamic=maybe", "compile.dynamic: got 'maybe', expected null or true or false"),
    ("compile.fulgraph=true", "unknown key 'compile.fulgraph'; did you mean 'compile.fullgraph'?"),
    ("compile={backend: eager, mode: max-autotune}",
     "compile.mode: got 'max-autotune', but modes are inductor's; compile.backend is 'eager'"),
    ("strategy.type=deepspeed", "compile: not under ZeRO stage 3"),
])
def test_a_bad_value_is_one_line_naming_the_key(tmp_path, override, message):
    overrides = ["compile=true", "strategy.zero_stage=3", override] \
        if override.startswith("strategy") else [override]
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, *overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_deepspeed_compiles_below_zero_3(tmp_path):
    cfg = _load(tmp_path, "compile=true", "strategy.type=deepspeed", "strategy.zero_stage=2")
    assert cfg.compile.backend == "inductor"


class NoCompileDDP(DDPStrategy):
    """A strategy of a user's that says nothing about compiling."""

    name = "no_compile_ddp"
    COMPILES = None


def test_a_strategy_that_does_not_compile_is_refused(tmp_path, monkeypatch):
    assert all(cls.COMPILES for cls in STRATEGIES.values())  # the shipped ones all compile
    monkeypatch.setitem(STRATEGIES, "no_compile_ddp", NoCompileDDP)
    with pytest.raises(ConfigError, match=r"^compile: strategy 'no_compile_ddp' does not "
                                          r"compile models; set compile: false$"):
        _load(tmp_path, "compile=true", "strategy.type=no_compile_ddp")
    with pytest.raises(ValueError, match="does not compile models"):  # built from objects
        Runner(DigitsMLP(), tmp_path / "run", strategy=NoCompileDDP(), compile=True)
    assert not (tmp_path / "run").exists()


def test_compiling_keeps_the_state_dict_keys_and_the_outputs():
    torch.manual_seed(0)
    model = DigitsMLP(dropout=0.0)
    keys = list(model.state_dict())
    batch = {"inputs": torch.rand(8, 64), "labels": torch.arange(8)}
    expected = model(batch)["loss"]
    compile_module(model, "model", {"backend": "eager"})
    assert list(model.state_dict()) == keys  # no '_orig_mod.'
    assert torch.equal(model(batch)["loss"], expected)
    assert model(batch, mode="predict").shape == (8,)  # the mode string: another graph
    model.load_state_dict(DigitsMLP(dropout=0.0).state_dict())  # an uncompiled model's state


def test_fullgraph_names_the_module_that_failed_where_a_graph_break_runs():
    batch = {"inputs": torch.rand(8, 64), "labels": torch.arange(8)}
    model = ItemDigitsMLP()
    compile_module(model.net, "model.net", {"backend": "eager", "fullgraph": True})
    model(batch)  # nothing breaks the graph in the net itself
    compile_module(model, "model", {"backend": "eager", "fullgraph": True})
    with pytest.raises(CompileFailed, match=r"^compile: fullgraph compile of ItemDigitsMLP "
                                            r"\(model\) failed: \S"):
        model(batch)
    # last: once compiled without fullgraph, dynamo keeps that verdict on this forward's code
    # for the whole process, and a later fullgraph compile of it no longer raises
    model = ItemDigitsMLP()
    compile_module(model, "model", {"backend": "eager"})
    assert model(batch)["loss"] > 0  # without fullgraph, the forward runs
