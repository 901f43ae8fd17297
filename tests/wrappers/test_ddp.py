"""MMDistributedDataParallel and the 'ddp' strategy on real gloo groups: averaged gradients,
the step contract, buffers, options, and naming parameters that got no gradient."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import trainrun.dist as dist
from tests.procs import released
from tests.runner.toy import ToyModel, UnusedParamModel, batch_of, flat_params
from trainrun.runner.optim import OptimWrapper
from trainrun.wrappers import DDPStrategy, MMDistributedDataParallel, is_model_wrapper
from trainrun.wrappers.ddp import parameters_without_grad_path

CPU = torch.device("cpu")


class CaptureLog(logging.Handler):
    """Collects the 'trainrun' logger's records while it is open."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logger = logging.getLogger("trainrun")
        self._level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("trainrun")
        logger.removeHandler(self)
        logger.setLevel(self._level)

    def errors(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]


# ---------------------------------------------------------------- gradients


def _averaged_gradients_body():
    rank, world = dist.get_dist_info()
    torch.manual_seed(rank)  # different weights on each rank before wrapping
    model = MMDistributedDataParallel(ToyModel(dropout=0.0))
    start = flat_params(model.module)
    reference = ToyModel(dropout=0.0)
    reference.load_state_dict(model.module.state_dict())

    wrapper = OptimWrapper(torch.optim.SGD(model.module.parameters(), lr=0.1))
    logged = model.train_step(batch_of(rank), wrapper)

    # one process on every rank's batch: the mean of the ranks' losses
    loss = sum(reference(batch_of(r))["loss"] for r in range(world)) / world
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    result = start, flat_params(model.module), flat_params(reference), logged["loss"].item()
    released(model, wrapper)
    return result


def test_train_step_averages_gradients_over_ranks(run_on):
    results = run_on(2)(_averaged_gradients_body)
    (start0, after0, expected0, loss0), (start1, after1, expected1, loss1) = results
    assert torch.equal(start0, start1)  # rank 0's weights reached rank 1 at wrapping
    assert torch.equal(after0, after1)  # the same averaged step on both
    assert not torch.equal(after0, start0)
    assert torch.allclose(after0, expected0, atol=1e-6)
    assert torch.equal(expected0, expected1)
    assert loss0 != loss1  # each rank logs the loss of its own batch


def _eval_steps_body():
    torch.manual_seed(0)
    model = MMDistributedDataParallel(ToyModel(dropout=0.5))
    model.eval()
    batch = batch_of(dist.get_rank())
    val, test = model.val_step(batch), model.test_step(batch)
    expected = model.module(batch, mode="predict")
    result = torch.equal(val, expected), torch.equal(test, expected), val.shape
    released(model)
    return result


def test_val_and_test_steps_are_the_modules(run_on):
    for val_ok, test_ok, shape in run_on(2)(_eval_steps_body):
        assert val_ok and test_ok and shape == (4,)


# ---------------------------------------------------------------- anomalous parameters


def test_parameters_without_grad_path_names_unreached_parameters():
    model = UnusedParamModel()
    loss = model(batch_of(0))["loss"]
    assert parameters_without_grad_path(loss, model) == ["unused.weight", "unused.bias"]
    model.unused.requires_grad_(False)  # frozen parameters are not anomalies
    assert parameters_without_grad_path(loss, model) == []
    model.net[0].weight.requires_grad_(False)
    loss = model(batch_of(0))["loss"]
    assert parameters_without_grad_path(loss, model) == []


def _anomalous_body(detect, model_cls):
    torch.manual_seed(0)
    model = MMDistributedDataParallel(model_cls(), detect_anomalous_params=detect,
                                      find_unused_parameters=True)
    wrapper = OptimWrapper(torch.optim.SGD(model.module.parameters(), lr=0.1))
    with CaptureLog() as log:
        for _ in range(2):
            model.train_step(batch_of(dist.get_rank()), wrapper)
    released(model, wrapper)
    return log.errors()


def test_detect_anomalous_params_names_parameters_without_gradient(run_on):
    for errors in run_on(2)(_anomalous_body, True, UnusedParamModel):
        assert errors == ["parameters that got no gradient this step: unused.weight, "
                          "unused.bias"] * 2


@pytest.mark.parametrize(("detect", "model_cls"), [(False, UnusedParamModel), (True, ToyModel)])
def test_detect_anomalous_params_is_silent_otherwise(run_on, detect, model_cls):
    assert run_on(2)(_anomalous_body, detect, model_cls) == [[], []]


# ---------------------------------------------------------------- buffers and options


class BufferModel(ToyModel):
    def __init__(self):
        super().__init__(dropout=0.0)
        self.register_buffer("stat", torch.zeros(2))


def _buffers_body(broadcast_buffers):
    rank = dist.get_rank()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = MMDistributedDataParallel(BufferModel(), broadcast_buffers=broadcast_buffers)
    model.module.stat.fill_(rank + 1.0)  # the ranks' buffers drift apart
    wrapper = OptimWrapper(torch.optim.SGD(model.module.parameters(), lr=0.1))
    model.train_step(batch_of(rank), wrapper)
    result = model.module.stat.tolist(), [str(w.message) for w in caught
                                          if issubclass(w.category, FutureWarning)]
    released(model, wrapper)
    return result


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_broadcast_buffers(run_on, broadcast_buffers):
    (stat0, warned0), (stat1, warned1) = run_on(2)(_buffers_body, broadcast_buffers)
    assert stat0 == [1.0, 1.0]
    assert stat1 == ([1.0, 1.0] if broadcast_buffers else [2.0, 2.0])
    assert warned0 == warned1 == []  # no deprecation warning on every wrap


def _strategy_body(options):
    torch.manual_seed(dist.get_rank())
    strategy = DDPStrategy(**options)
    model, optimizer = strategy.setup(ToyModel(), CPU,
                                      lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    seen = {
        "type": type(model).__name__,
        "wrapper": is_model_wrapper(model),
        "find_unused_parameters": model.find_unused_parameters,
        "bucket_bytes_cap": model.bucket_bytes_cap,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "static_graph": model.static_graph,
        "detect_anomalous_params": model.detect_anomalous_params,
        "optimizer_over_module": [id(p) for g in optimizer.param_groups for p in g["params"]]
        == [id(p) for p in model.module.parameters()],
        "unwrap": strategy.unwrap(model) is model.module,
        "keys": sorted(strategy.model_state_dict(model)),
    }
    state = {k: torch.full_like(v, 0.5) for k, v in strategy.model_state_dict(model).items()}
    strategy.load_model_state_dict(model, state)
    seen["loaded"] = bool((flat_params(model.module) == 0.5).all())
    released(model, optimizer)
    return seen


def test_ddp_strategy_wraps_with_its_options(run_on):
    options = {"find_unused_parameters": True, "bucket_cap_mb": 1, "static_graph": False,
               "gradient_as_bucket_view": True, "detect_anomalous_params": True}
    for seen in run_on(2)(_strategy_body, options):
        assert seen == {
            "type": "MMDistributedDataParallel", "wrapper": True,
            "find_unused_parameters": True, "bucket_bytes_cap": 1024 * 1024,
            "gradient_as_bucket_view": True, "static_graph": False,
            "detect_anomalous_params": True, "optimizer_over_module": True, "unwrap": True,
            "keys": sorted(ToyModel().state_dict()), "loaded": True,
        }


def test_ddp_strategy_without_a_group_does_not_wrap():
    strategy = DDPStrategy()
    model = ToyModel()
    wrapped, optimizer = strategy.setup(model, CPU, None)
    assert wrapped is model and optimizer is None and not is_model_wrapper(wrapped)
    assert sorted(strategy.model_state_dict(wrapped)) == sorted(model.state_dict())
