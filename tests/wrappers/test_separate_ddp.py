"""MMSeparateDistributedDataParallel and the 'separate_ddp' strategy on real gloo groups:
one DDP per trainable submodule, the module's own train_step, and plain checkpoint keys."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainrun.dist as dist
from tests.procs import released
from tests.records import train_records
from tests.runner.toy import CrashAfter, Killed, TwoNets, batch_of, flat_grads, flat_params
from trainrun.checkpoint.format import load_state_file
from trainrun.examples.gan import ToyGAN
from trainrun.runner.optim import OptimWrapper, OptimWrapperDict
from trainrun.runner.runner import Runner
from trainrun.wrappers import (
    MMSeparateDistributedDataParallel,
    SeparateDDPStrategy,
    is_model_wrapper,
)

CPU = torch.device("cpu")


def make_optimizers(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    return {name: torch.optim.SGD(getattr(model, name).parameters(), lr=0.1, momentum=0.9)
            for name in ("a", "b")}


def wrappers(optimizers) -> OptimWrapperDict:
    return OptimWrapperDict({name: OptimWrapper(opt) for name, opt in optimizers.items()})


def _setup(seed):
    torch.manual_seed(seed)
    return SeparateDDPStrategy().setup(TwoNets(), CPU, make_optimizers)


def _wrap_and_step_body():
    rank, world = dist.get_dist_info()
    model, optimizers = _setup(seed=rank)
    inner = model.module
    layout = {name: type(child).__name__ for name, child in inner.named_children()}
    start = {name: flat_params(getattr(inner, name)) for name in ("a", "b", "frozen")}

    reference = TwoNets()
    reference.load_state_dict(model.plain_state_dict())
    logged = model.train_step(batch_of(rank), wrappers(optimizers))
    for loss_of in (reference.loss_a, reference.loss_b):
        (sum(loss_of(batch_of(r)) for r in range(world)) / world).backward()
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    result = {
        "layout": layout,
        "train_steps": inner.train_steps,
        "logged": sorted(logged),
        "start": start,
        "after": {name: flat_params(getattr(inner, name)) for name in ("a", "b")},
        "expected": {name: flat_params(getattr(reference, name)) for name in ("a", "b")},
        "is_wrapper": is_model_wrapper(model),
        "wrapper_type": type(model) is MMSeparateDistributedDataParallel,
    }
    released(model, optimizers)
    return result


def test_each_trainable_submodule_gets_its_own_ddp(run_on):
    results = run_on(2)(_wrap_and_step_body)
    for result in results:
        assert result["layout"] == {"a": "DistributedDataParallel",
                                    "b": "DistributedDataParallel", "frozen": "Linear"}
        assert result["train_steps"] == 1  # the module's own train_step ran, once
        assert result["logged"] == ["loss", "loss_a", "loss_b"]
        assert result["is_wrapper"] and result["wrapper_type"]
        for name in ("a", "b"):
            assert torch.allclose(result["after"][name], result["expected"][name], atol=1e-6)
    first, second = results
    for name in ("a", "b"):
        assert torch.equal(first["start"][name], second["start"][name])  # rank 0's weights
        assert torch.equal(first["after"][name], second["after"][name])  # averaged steps
        assert not torch.equal(first["after"][name], first["start"][name])
    # a submodule without trainable parameters is not wrapped, so not synchronised
    assert not torch.equal(first["start"]["frozen"], second["start"]["frozen"])


def _no_sync_body():
    rank = dist.get_rank()
    model, optimizers = _setup(seed=0)
    inner = model.module
    with model.no_sync():
        inner.loss_a(batch_of(rank)).backward()
        inner.loss_b(batch_of(rank)).backward()
    local = flat_grads(inner)
    for p in inner.parameters():
        p.grad = None
    inner.loss_a(batch_of(rank)).backward()
    inner.loss_b(batch_of(rank)).backward()
    synced = flat_grads(inner)
    released(model, optimizers)
    return local, synced


def test_no_sync_covers_every_wrapped_submodule(run_on):
    (local0, synced0), (local1, synced1) = run_on(2)(_no_sync_body)
    assert not torch.equal(local0, local1)
    assert torch.equal(synced0, synced1)
    assert torch.allclose(synced0, (local0 + local1) / 2, atol=1e-6)


def _state_body(base):
    rank = dist.get_rank()
    strategy = SeparateDDPStrategy()
    model, optimizers = _setup(seed=0)
    model.train_step(batch_of(rank), wrappers(optimizers))
    plain = strategy.model_state_dict(model)
    raw_keys = sorted(model.module.state_dict())
    path = str(Path(base) / "ckpt.pth")
    strategy.save_checkpoint(path, model, optimizers, {"meta": {"iter": 1}})

    fresh, fresh_optimizers = _setup(seed=5)
    extra = strategy.load_checkpoint(path, fresh, fresh_optimizers)
    restored = all(torch.equal(v, fresh.plain_state_dict()[k]) for k, v in plain.items())
    momentum = [torch.equal(fresh_optimizers[n].state_dict()["state"][0]["momentum_buffer"],
                            optimizers[n].state_dict()["state"][0]["momentum_buffer"])
                for n in ("a", "b")]
    released(model, optimizers, fresh, fresh_optimizers)
    return sorted(plain), raw_keys, restored, momentum, extra


def test_checkpoints_carry_the_plain_models_keys(run_on, tmp_path):
    for keys, raw_keys, restored, momentum, extra in run_on(2)(_state_body, str(tmp_path)):
        assert keys == sorted(TwoNets().state_dict())
        assert "a.module.weight" in raw_keys and "a.weight" not in raw_keys
        assert restored and momentum == [True, True]
        assert extra == {"meta": {"iter": 1}}
    # the file loads into the plain model of a one-process run
    state = load_state_file(str(tmp_path / "ckpt.pth"))
    plain = TwoNets()
    plain.load_state_dict(state["model"])
    assert set(state["optimizer"]) == {"a", "b"}


def _gan_body():
    from trainrun.runner.optim import optimizer_factory, wrap_optimizers

    torch.manual_seed(dist.get_rank())
    make = optimizer_factory({"type": "Adam", "lr": 1e-3,
                              "per_module": {"generator": {}, "discriminator": {"lr": 2e-3}}})
    model, optimizers = SeparateDDPStrategy().setup(ToyGAN(hidden=8, depth=1), CPU, make)
    optim_wrapper = wrap_optimizers(optimizers, {}, "fp32", "cpu")
    wrapped = [type(getattr(model.module, n)) for n in ("generator", "discriminator")]
    losses = [model.train_step({"inputs": torch.randn(8, 2)}, optim_wrapper)["loss"].item()
              for _ in range(3)]
    points = model.val_step({"noise": torch.zeros(3, 2)})
    result = wrapped, losses, flat_params(model.module), points.shape
    released(model, optimizers, optim_wrapper)
    return result


def test_a_gan_trains_with_two_optimisers(run_on):
    (wrapped, losses0, params0, shape), (_, losses1, params1, _) = run_on(2)(_gan_body)
    assert wrapped == [DistributedDataParallel, DistributedDataParallel]
    assert all(torch.isfinite(torch.tensor(losses0 + losses1)))
    assert losses0 != losses1  # each rank its own noise and data
    assert torch.equal(params0, params1)  # both submodules stepped in sync
    assert shape == (3,)


def test_without_a_group_nothing_is_wrapped():
    model, optimizers = _setup(seed=0)
    assert type(model) is TwoNets and not is_model_wrapper(model)
    model.train_step(batch_of(0), wrappers(optimizers))
    assert model.train_steps == 1
    assert sorted(SeparateDDPStrategy().model_state_dict(model)) == sorted(model.state_dict())


def _gan_runner(work_dir, resume=False, crash_after=None):
    return Runner(
        model={"type": "ToyGAN", "hidden": 8, "depth": 1}, work_dir=work_dir,
        train_dataloader={"type": "gaussian_mixture", "size": 64, "batch_size": 8},
        optim={"type": "Adam", "lr": 1e-3, "accumulate": 2,
               "per_module": {"generator": {}, "discriminator": {"lr": 2e-3}}},
        strategy={"type": "separate_ddp"}, schedule={"max_iters": 7}, randomness={"seed": 5},
        logging={"interval": 1, "backends": ["jsonl"]}, checkpoint={"interval": 3},
        resume=resume, hooks=[CrashAfter(crash_after)] if crash_after else [],
    )


def _gan_resume_body(straight_dir, work_dir):
    runner = _gan_runner(straight_dir)
    runner.train()
    runner.close()
    runner = _gan_runner(work_dir, crash_after=5)
    try:
        runner.train()
    except Killed:
        pass
    runner.close()
    runner = _gan_runner(work_dir, resume=True)
    runner.train()
    runner.close()


def test_a_gan_resumes_exactly_from_a_separate_ddp_checkpoint(run_on, tmp_path):
    """Two optimisers, accumulation over 2 steps, a checkpoint between two steps (iter_3)."""

    def logged(work_dir):
        return [(r["step"], r["loss_d"], r["loss_g"]) for r in train_records(work_dir)]

    run_on(2)(_gan_resume_body, str(tmp_path / "straight"), str(tmp_path / "resumed"))
    straight, resumed = logged(tmp_path / "straight"), logged(tmp_path / "resumed")
    # the lines of steps 4 and 5, which the resumed run trains again, taken out: each step once
    assert [step for step, _, _ in resumed] == list(range(1, 8))
    assert resumed == straight  # bit for bit
    saved = load_state_file(str(tmp_path / "resumed" / "checkpoints" / "iter_7.pth"))
    assert sorted(saved["model"]) == sorted(ToyGAN(hidden=8, depth=1).state_dict())
    assert set(saved["optimizer"]) == {"generator", "discriminator"}
