"""MMEngine-style registries: registering, looking up and building, and the registries that
share trainrun's names."""

from __future__ import annotations

import pytest
import torch

from trainrun import registry as trainrun_registry
from trainrun.compat.mmengine import registry as compat
from trainrun.compat.mmengine.registry import (
    FUNCTIONS,
    MODELS,
    OPTIMIZERS,
    PARAM_SCHEDULERS,
    Registry,
    build_from_cfg,
)


class Point:
    def __init__(self, x: int, y: int = 0) -> None:
        self.x, self.y = x, y


def test_register_as_decorator_by_call_and_under_names():
    things = Registry("thing")

    @things.register_module()
    class Box:
        pass

    @things.register_module(name=["Crate", "Case"])
    def crate() -> str:
        return "crate"

    assert things.register_module(module=Point) is Point
    assert things.get("Box") is Box and things.get("Crate") is crate is things.get("Case")
    assert "Point" in things and "Nothing" not in things and len(things) == 4
    assert things.names() == ["Box", "Case", "Crate", "Point"]
    assert things.get("Nothing") is None
    assert things.get("torch.nn.Linear") is torch.nn.Linear  # an import path
    assert things.get("no_such_module.Thing") is None


def test_a_duplicate_name_is_a_key_error_unless_forced():
    things = Registry("thing")
    things.register_module(module=Point)
    with pytest.raises(KeyError, match="'Point' is already registered in the thing registry "
                                       r"\(as .*test_registry.Point\); pass force=True"):
        things.register_module(module=Point)

    @things.register_module(name="Point", force=True)
    class Other:
        pass

    assert things.get("Point") is Other


def test_register_refuses_what_is_not_a_name_or_callable():
    things = Registry("thing")
    with pytest.raises(TypeError, match="force must be a bool"):
        things.register_module(force=1)
    with pytest.raises(TypeError, match="name must be None, a str or a sequence of str"):
        things.register_module(name=3)
    with pytest.raises(TypeError, match="only a class or function can be registered"):
        things.register_module(name="x", module=5)
    with pytest.raises(TypeError, match="takes a name"):
        things.get(Point)


def test_build_by_name_class_and_default_args():
    things = Registry("thing")
    things.register_module(module=Point)
    point = things.build(dict(type="Point", x=1), default_args=dict(x=5, y=2))
    assert (point.x, point.y) == (1, 2)  # the config's keys win over the defaults
    point = build_from_cfg(dict(x=3), things, default_args=dict(type=Point))
    assert (point.x, point.y) == (3, 0)
    assert things.build(dict(type=lambda a: a * 2, a=4)) == 8
    assert isinstance(things.build(dict(type="torch.nn.Identity")), torch.nn.Identity)


def test_build_errors_name_the_registry_and_the_type():
    things = Registry("thing")
    things.register_module(module=Point)
    with pytest.raises(KeyError, match="'Pont' is not in the thing registry; did you mean "
                                       "'Point'[?] Registered: Point"):
        things.build(dict(type="Pont", x=1))
    with pytest.raises(KeyError, match="'my_pkg.Thing' is not in the thing registry "
                                       r"\(.*no module named 'my_pkg'"):
        things.build(dict(type="my_pkg.Thing"))
    with pytest.raises(KeyError, match="the config has no 'type'"):
        things.build(dict(x=1))
    with pytest.raises(TypeError, match="cfg must be a dict; got str"):
        things.build("Point")
    with pytest.raises(TypeError, match="type must be a name"):
        things.build(dict(type=3))
    with pytest.raises(TypeError, match="registry must be"):
        build_from_cfg(dict(type="Point", x=1), trainrun_registry.MODELS)


def test_a_class_with_get_instance_is_built_through_it():
    class Shared:
        made: list = []

        def __init__(self, name: str) -> None:
            self.name = name

        @classmethod
        def get_instance(cls, name: str) -> Shared:
            cls.made.append(name)
            return cls(name)

    assert build_from_cfg(dict(type=Shared, name="hub"), Registry("thing")).name == "hub"
    assert Shared.made == ["hub"]


def test_models_share_trainruns_names():
    class CompatNet(torch.nn.Module):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(width, width)

    MODELS.register_module(module=CompatNet)
    try:
        # a trainrun config names it, and trainrun's shipped models build from here
        assert trainrun_registry.resolve("model", "CompatNet") is CompatNet
        assert "DigitsMLP" in MODELS
        assert MODELS.get("DigitsMLP") is trainrun_registry.MODELS["DigitsMLP"]
        stacked = MODELS.build([dict(type="CompatNet"), dict(type="CompatNet", width=3)])
        assert isinstance(stacked, torch.nn.Sequential) and len(stacked) == 2
    finally:
        del trainrun_registry.MODELS["CompatNet"]
    assert "CompatNet" not in MODELS


def test_backed_and_own_registries():
    assert compat.MODELS.backend is trainrun_registry.MODELS
    assert compat.DATASETS.backend is trainrun_registry.DATASETS
    assert compat.METRICS.backend is trainrun_registry.METRICS
    assert compat.HOOKS.backend is trainrun_registry.HOOKS
    assert compat.STRATEGIES.backend is not trainrun_registry.STRATEGIES
    for name in ("DATA_SAMPLERS", "TRANSFORMS", "EVALUATOR", "OPTIM_WRAPPERS", "LOOPS",
                 "LOG_PROCESSORS", "VISUALIZERS", "MODEL_WRAPPERS", "RUNNERS", "STRATEGIES"):
        assert isinstance(getattr(compat, name), Registry), name


def test_optimizers_know_torchs_by_name():
    assert OPTIMIZERS.get("SGD") is torch.optim.SGD and OPTIMIZERS.get("AdamW") is torch.optim.AdamW
    assert "Optimizer" not in OPTIMIZERS
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = OPTIMIZERS.build(dict(type="SGD", lr=0.1), default_args=dict(params=params))
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"] == 0.1
    with pytest.raises(KeyError, match="did you mean 'SGD'"):
        OPTIMIZERS.build(dict(type="SDG", lr=0.1, params=params))


def test_functions_name_the_collates_lazily():
    assert "default_collate" in FUNCTIONS and "pseudo_collate" in FUNCTIONS
    assert FUNCTIONS.backend.target("pseudo_collate") == \
        "trainrun.compat.mmengine.dataset:pseudo_collate"


class Scheduler:
    def __init__(self, optimizer: str, by_epoch: bool = True) -> None:
        self.optimizer, self.by_epoch, self.epoch_length = optimizer, by_epoch, None

    @classmethod
    def build_iter_from_epoch(cls, epoch_length: int, **kwargs) -> Scheduler:
        made = cls(**kwargs)
        made.epoch_length = epoch_length
        return made


def test_schedulers_convert_to_iter_based():
    PARAM_SCHEDULERS.register_module(module=Scheduler)
    try:
        _build_schedulers()
    finally:
        del PARAM_SCHEDULERS.backend["Scheduler"]


def _build_schedulers():
    plain = PARAM_SCHEDULERS.build(dict(type="Scheduler"), default_args=dict(
        optimizer="opt", epoch_length=10))
    assert plain.optimizer == "opt" and plain.epoch_length is None
    converted = PARAM_SCHEDULERS.build(dict(type="Scheduler", convert_to_iter_based=True),
                                       default_args=dict(optimizer="opt", epoch_length=10))
    assert converted.epoch_length == 10
    with pytest.raises(ValueError, match="needs an epoch-based scheduler"):
        PARAM_SCHEDULERS.build(dict(type="Scheduler", convert_to_iter_based=True),
                               default_args=dict(optimizer="opt"))


def test_locations_are_imported_on_the_first_lookup(monkeypatch):
    imported = []
    monkeypatch.setattr(compat.importlib, "import_module", imported.append)
    things = Registry("thing", locations=["my_project.things"])
    assert imported == []
    assert "X" not in things
    assert imported == ["my_project.things"]
    things.names()
    assert imported == ["my_project.things"]  # once
