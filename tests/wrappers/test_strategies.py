"""The strategy registry, the model contract, the single-device strategy, is_model_wrapper,
and checkpoint files written by rank 0 (reading them safely: tests/checkpoint/)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainrun.dist as dist
from tests.runner.toy import (
    ToyModel,
    TwoNets,
    batch_of,
    flat_params,
)
from trainrun.checkpoint.format import load_state_file
from trainrun.runner.optim import OptimWrapper, OptimWrapperDict
from trainrun.wrappers import (
    STRATEGIES,
    BaseModel,
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    MMDistributedDataParallel,
    MMSeparateDistributedDataParallel,
    SeparateDDPStrategy,
    SingleDeviceStrategy,
    Strategy,
    build_strategy,
    is_model_wrapper,
    parse_losses,
)

CPU = torch.device("cpu")


def sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


# ---------------------------------------------------------------- registry


def test_registry_names_every_strategy_class():
    expected = {"none": SingleDeviceStrategy, "ddp": DDPStrategy,
                "separate_ddp": SeparateDDPStrategy, "deepspeed": DeepSpeedStrategy,
                "fsdp": FSDPStrategy}
    assert STRATEGIES == expected  # every one, and no other
    for name, cls in STRATEGIES.items():
        assert cls.name == name


def test_build_strategy_merges_options_over_defaults():
    strategy = build_strategy("ddp", find_unused_parameters=True, bucket_cap_mb=1)
    assert isinstance(strategy, DDPStrategy)
    assert strategy.options == {**DDPStrategy.OPTIONS, "find_unused_parameters": True,
                                "bucket_cap_mb": 1}
    assert DDPStrategy.OPTIONS["find_unused_parameters"] is False  # defaults left alone
    assert build_strategy("none").options == {}


def test_build_strategy_rejects_unknown_names_and_options():
    listed = r"one of none, ddp, separate_ddp, (?=.*fsdp)(?=.*deepspeed).*got 'dpp'"
    with pytest.raises(ValueError, match=listed):
        build_strategy("dpp")
    with pytest.raises(ValueError, match=r"'ddp' takes no option 'sharding'; its options are: "
                                         r"broadcast_buffers, bucket_cap_mb"):
        build_strategy("ddp", sharding="full")
    with pytest.raises(ValueError, match=r"'none' takes no option 'x'; its options are: none"):
        build_strategy("none", x=1)


class _OneLine(Strategy):
    name = "one_line"
    OPTIONS = {"scale": 1.0}

    def setup(self, model, device, make_optimizer):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(self.options["scale"])
        return model, make_optimizer(model) if make_optimizer else None


def test_a_new_strategy_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "one_line", _OneLine)
    model = ToyModel()
    before = flat_params(model)
    strategy = build_strategy("one_line", scale=2.0)
    wrapped, optimizer = strategy.setup(model, CPU, sgd)
    assert torch.equal(flat_params(wrapped), 2 * before)
    assert isinstance(optimizer, torch.optim.SGD)
    with pytest.raises(TypeError):
        Strategy()  # abstract: setup is required


class _Wrapped(nn.Module):
    """A wrapper that only `_OwnWrapper` declares."""


class _OwnWrapper(SingleDeviceStrategy):
    name = "own_wrapper"
    WRAPPERS = (_Wrapped,)


def test_wrappers_are_those_of_the_registered_strategies(monkeypatch):
    assert not is_model_wrapper(_Wrapped())  # defined, but not registered: not asked
    monkeypatch.setitem(STRATEGIES, "own_wrapper", _OwnWrapper)
    assert is_model_wrapper(_Wrapped())


# ---------------------------------------------------------------- the model contract


def test_parse_losses_sums_loss_entries_and_logs_means():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    losses = {"loss_a": w * 2, "loss_b": w.sum(), "acc": torch.tensor([0.5, 1.0])}
    loss, logged = parse_losses(losses)
    assert loss.item() == pytest.approx(3.0 + 3.0)
    assert loss.requires_grad
    loss.backward()
    assert w.grad.tolist() == [2.0, 2.0]  # d/dw of mean(2w) + sum(w)
    assert set(logged) == {"loss_a", "loss_b", "acc", "loss"}
    assert logged["acc"].item() == 0.75 and logged["loss_a"].item() == 3.0
    assert not any(v.requires_grad for v in logged.values())
    single, _ = parse_losses({"loss": torch.tensor([1.0, 3.0])})
    assert single.item() == 2.0


@pytest.mark.parametrize(("losses", "error", "words"), [
    ({}, TypeError, "must return a dict"),
    (torch.tensor(1.0), TypeError, "must return a dict"),
    ({"acc": torch.tensor(1.0)}, ValueError, r"no entry named '\*loss\*': \['acc'\]"),
])
def test_parse_losses_rejects_what_is_not_a_loss_dict(losses, error, words):
    with pytest.raises(error, match=words):
        parse_losses(losses)


def test_base_model_steps_through_the_optimiser_wrapper():
    torch.manual_seed(0)
    model = ToyModel(dropout=0.0)
    reference = ToyModel(dropout=0.0)
    reference.load_state_dict(model.state_dict())
    batch = batch_of(0)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    logged = model.train_step(batch, wrapper)
    expected_loss = reference(batch)["loss"]
    assert logged["loss"].item() == expected_loss.item()
    expected_loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    assert torch.allclose(flat_params(model), flat_params(reference))
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step
    predicted = model.val_step(batch)
    assert predicted.shape == (4,) and torch.equal(predicted, model.test_step(batch))
    assert torch.equal(predicted, model(batch, mode="predict"))
    assert issubclass(ToyModel, BaseModel)


# ---------------------------------------------------------------- single device


def test_single_device_strategy_leaves_the_model_as_it_is():
    model = ToyModel()
    wrapped, optimizer = SingleDeviceStrategy().setup(model, CPU, sgd)
    assert wrapped is model and not is_model_wrapper(wrapped)
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == \
        [id(p) for p in model.parameters()]
    assert SingleDeviceStrategy().setup(ToyModel(), CPU, None)[1] is None


def _single_on_ranks_body():
    """Strategy 'none' in a job of 2: a warning, and no gradient averaging."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("trainrun")
    logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        model, optimizer = SingleDeviceStrategy().setup(ToyModel(dropout=0.0), CPU, sgd)
    finally:
        logger.removeHandler(handler)
    model.train_step(batch_of(dist.get_rank()), OptimWrapper(optimizer))
    return [r.getMessage() for r in records], flat_params(model)


def test_single_device_strategy_on_two_ranks_warns_and_does_not_sync(run_on):
    (messages, params0), (_, params1) = run_on(2)(_single_on_ranks_body)
    assert any("strategy 'none' in a job of 2 processes" in m for m in messages)
    assert not torch.equal(params0, params1)


# ---------------------------------------------------------------- is_model_wrapper


class DeepSpeedEngine(nn.Module):
    """Named like DeepSpeed's engine, which is recognised without importing DeepSpeed."""


def test_is_model_wrapper_without_a_group():
    assert not is_model_wrapper(ToyModel())
    assert not is_model_wrapper(nn.Linear(2, 2))
    assert not is_model_wrapper(object())
    assert is_model_wrapper(DeepSpeedEngine())

    class Engine(DeepSpeedEngine):
        pass

    assert is_model_wrapper(Engine())


def _is_wrapper_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    answers = {
        "torch_ddp": is_model_wrapper(DistributedDataParallel(ToyModel())),
        "mm_ddp": is_model_wrapper(MMDistributedDataParallel(ToyModel())),
        "separate": is_model_wrapper(MMSeparateDistributedDataParallel(TwoNets())),
        "plain": is_model_wrapper(ToyModel()),
    }
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    answers["fsdp2"] = is_model_wrapper(fully_shard(ToyModel(), mesh=mesh))
    gc.collect()  # no DDP reducer may outlive the group
    return answers


def test_is_model_wrapper_knows_every_wrapper(run_on):
    for answers in run_on(2)(_is_wrapper_body):
        assert answers == {"torch_ddp": True, "mm_ddp": True, "separate": True,
                           "plain": False, "fsdp2": True}


# ---------------------------------------------------------------- checkpoint files


def test_save_and_load_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    strategy = SingleDeviceStrategy()
    model, optimizer = strategy.setup(ToyModel(dropout=0.0), CPU, sgd)
    model.train_step(batch_of(0), OptimWrapper(optimizer))  # momentum buffers exist now
    path = tmp_path / "ckpt.pth"
    strategy.save_checkpoint(str(path), model, optimizer,
                             {"meta": {"iter": 7}, "rng": [torch.get_rng_state()]})
    assert path.is_file()

    torch.manual_seed(1)
    fresh, fresh_optimizer = strategy.setup(ToyModel(dropout=0.0), CPU, sgd)
    assert not torch.equal(flat_params(fresh), flat_params(model))
    extra = strategy.load_checkpoint(str(path), fresh, fresh_optimizer)
    assert torch.equal(flat_params(fresh), flat_params(model))
    saved = optimizer.state_dict()["state"]
    loaded = fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and len(saved) == 4
    for key in saved:
        assert torch.equal(saved[key]["momentum_buffer"], loaded[key]["momentum_buffer"])
    assert set(extra) == {"meta", "rng"} and extra["meta"] == {"iter": 7}
    # the same next step from both
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        m.train_step(batch_of(1), OptimWrapper(o))
    assert torch.equal(flat_params(fresh), flat_params(model))


def test_checkpoint_with_one_optimiser_per_submodule(tmp_path):
    strategy = SeparateDDPStrategy()

    def make(module):
        return {"a": sgd(module.a), "b": sgd(module.b)}

    model, optimizers = strategy.setup(TwoNets(), CPU, make)
    assert not is_model_wrapper(model)  # no group: nothing to wrap
    model.train_step(batch_of(0), OptimWrapperDict({k: OptimWrapper(o)
                                                    for k, o in optimizers.items()}))
    strategy.save_checkpoint(str(tmp_path / "c.pth"), model, optimizers, {})
    fresh, fresh_optimizers = strategy.setup(TwoNets(), CPU, make)
    strategy.load_checkpoint(str(tmp_path / "c.pth"), fresh, fresh_optimizers)
    assert torch.equal(flat_params(fresh), flat_params(model))
    for name in ("a", "b"):
        assert fresh_optimizers[name].state_dict()["state"].keys() == {0, 1}
        assert torch.equal(fresh_optimizers[name].state_dict()["state"][0]["momentum_buffer"],
                           optimizers[name].state_dict()["state"][0]["momentum_buffer"])


def _save_from_rank0_body(base):
    """Each rank names its own file: only rank 0's may appear, and after the call every rank
    sees it complete (the save ends in a barrier)."""
    rank = dist.get_rank()
    strategy = DDPStrategy()
    torch.manual_seed(rank)
    model, optimizer = strategy.setup(ToyModel(), CPU, sgd)
    path = Path(base) / f"rank{rank}.pth"
    strategy.save_checkpoint(str(path), model, optimizer, {"meta": {"rank": rank}})
    exists_after = (Path(base) / "rank0.pth").is_file()
    state = load_state_file(str(Path(base) / "rank0.pth"))
    result = exists_after, path.exists(), state["meta"], flat_params(model)
    del model, optimizer
    gc.collect()  # no DDP reducer may outlive the group
    return result


def test_save_checkpoint_writes_from_rank_zero_only(run_on, tmp_path):
    results = run_on(2)(_save_from_rank0_body, str(tmp_path))
    assert [r[0] for r in results] == [True, True]
    assert [r[1] for r in results] == [True, False]
    assert [r[2] for r in results] == [{"rank": 0}, {"rank": 0}]
    assert torch.equal(results[0][3], results[1][3])  # DDP gave rank 1 rank 0's weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pth"]


def test_every_shipped_wrapper_meets_the_declared_contracts():
    from trainrun.runner.optim import OptimWrapper, OptimWrapperDict
    from trainrun.wrappers import ModelContract, OptimWrapperContract, StepOptimWrapper
    from trainrun.wrappers.deepspeed import DeepSpeedOptimWrapper, MMDeepSpeedEngineWrapper
    from trainrun.wrappers.fsdp import MMFullyShardedDataParallel

    for cls in (BaseModel, MMDistributedDataParallel, MMSeparateDistributedDataParallel,
                MMFullyShardedDataParallel, MMDeepSpeedEngineWrapper):
        assert issubclass(cls, ModelContract), cls.__name__
    assert not issubclass(torch.nn.Linear, ModelContract)  # no train_step: not a model
    for cls in (OptimWrapper, DeepSpeedOptimWrapper):
        assert issubclass(cls, StepOptimWrapper), cls.__name__
    assert issubclass(OptimWrapperDict, OptimWrapperContract)  # its values are StepOptimWrappers
    assert not issubclass(torch.optim.SGD, OptimWrapperContract)
