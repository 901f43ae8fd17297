"""The keys of a model or data section checked against the class they go to (issue 22): a key
the class does not take, or an argument it needs, is a one-line ConfigError naming the key,
whether the config comes through the command line (``check_types``, dry run included) or a
``Runner(...)`` built from Python (``construct``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainrun.runner.builder import build_dataloader, build_model, check_arguments, check_types
from trainrun.runner.config import load_config
from trainrun.runner.runner import Runner
from trainrun.runner.schema import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_single.yaml"
NEWCOMER = "tests.tools.newcomer"
HIDEN = "unknown key 'model.hiden'; did you mean 'model.hidden'?"
SISE = "unknown key 'data.train.batch_sise'; did you mean 'data.train.batch_size'?"


def _checked(*overrides: str) -> None:
    check_types(load_config(CONFIG, list(overrides)))


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.hiden=64"], HIDEN),
    (["data.train.batch_sise=8"], SISE),
    (["data.val.spilt=test"], "unknown key 'data.val.spilt'; did you mean 'data.val.split'?"),
    ([f"data.train.type={NEWCOMER}.FolderDigits"],
     f"data.train.root: missing; {NEWCOMER}.FolderDigits needs it (an argument without a "
     f"default)"),
], ids=["model", "data-loader-option", "data-set-argument", "missing"])
def test_check_types_refuses_keys_the_class_does_not_take(overrides, message):
    with pytest.raises(ConfigError) as error:
        _checked(*overrides)
    assert str(error.value) == message


def test_a_key_near_nothing_lists_what_the_section_takes():
    with pytest.raises(ConfigError) as error:
        _checked("data.train.colour=blue")
    message = str(error.value)
    assert message.startswith("unknown key 'data.train.colour'; expected one of type, ")
    assert all(f" {key}," in message for key in ("batch_size", "split", "val_fraction"))


def test_classes_taking_any_keyword_are_left_to_their_constructor():
    _checked(f"model.type={NEWCOMER}.OpenDigitsMLP", "model.colour=blue",
             f"data.train.type={NEWCOMER}.OpenDigits", "data.train.batch_sise=8")
    model = build_model({"type": f"{NEWCOMER}.OpenDigitsMLP", "colour": "blue"})
    assert model.extra == {"colour": "blue"}
    with pytest.raises(ConfigError, match=r"^data.train.root: missing"):  # what it needs still
        check_arguments("data.train", "Folder", lambda root, **extra: None, {"size": 3})
    check_arguments("data.train", "int", int, {"anything": 1})  # no signature: left to int


def test_construct_gives_the_same_line_to_a_runner_built_from_python(tmp_path):
    with pytest.raises(ConfigError) as error:
        build_model({"type": "DigitsMLP", "hiden": 64})
    assert str(error.value) == HIDEN
    with pytest.raises(ConfigError) as error:
        build_dataloader({"type": "digits", "batch_sise": 8}, seed=0, train=True,
                         key="data.train")
    assert str(error.value) == SISE
    with pytest.raises(ConfigError) as error:
        Runner(model={"type": "DigitsMLP", "hiden": 64}, work_dir=tmp_path / "run",
               train_dataloader={"type": "digits", "batch_size": 8})
    assert str(error.value) == HIDEN
    assert not (tmp_path / "run").exists()


def test_an_argument_named_target_is_checked_like_any_other() -> None:
    """call_mismatch's own first parameter is positional-only: an option called ``target``
    (a hook's, a model's) is the class's, not a clash that crashes the check."""
    from trainrun.runner.schema import call_mismatch

    class Goal:
        def __init__(self, target: float = 1.0):
            self.target = target

    assert call_mismatch(Goal, target=0.5) is None
    assert "target2" in call_mismatch(Goal, target2=0.5)
