"""The optimiser wrapper: accumulation (no gradient all-reduce on micro-steps that do not
step, checked on a real gloo group), clipping, bf16/fp16, state, and optimisers by name."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import trainrun.dist as dist
from tests.runner.toy import ToyModel, batch_of, flat_grads, flat_params
from trainrun.runner.optim import OptimWrapper, OptimWrapperDict, build_optimizer
from trainrun.runner.optim.wrapper import grad_norms, measure_grad_norm
from trainrun.wrappers import MMDistributedDataParallel

# ---------------------------------------------------------------- build_optimizer


def test_build_optimizer_by_torch_class_name():
    params = [nn.Parameter(torch.zeros(2))]
    cfg = {"type": "AdamW", "lr": 3e-4, "weight_decay": 0.1, "betas": (0.8, 0.9)}
    optimizer = build_optimizer(params, cfg)
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (3e-4, 0.1, (0.8, 0.9))
    assert group["params"] == params
    assert cfg["type"] == "AdamW"  # the config is not consumed
    assert type(build_optimizer(params, {"type": "SGD", "lr": 0.1})) is torch.optim.SGD


@pytest.mark.parametrize("name", ["Adamm", "lr_scheduler", "swa_utils"])
def test_build_optimizer_rejects_what_is_not_an_optimiser(name):
    with pytest.raises(ValueError, match=f"optim.type={name!r} is not an optimiser"):
        build_optimizer([nn.Parameter(torch.zeros(1))], {"type": name, "lr": 0.1})


# ---------------------------------------------------------------- accumulation


class Recorder(nn.Module):
    """A model with ``no_sync`` that records whether a forward ran inside it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.inside = False
        self.forwards: list[bool] = []

    @contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, x):
        self.forwards.append(self.inside)
        return (self.w * x).sum()


def test_optim_context_skips_sync_on_micro_steps_that_do_not_step():
    model = Recorder()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    steps = []
    for _ in range(7):
        steps.append(wrapper.will_step)
        with wrapper.optim_context(model):
            loss = model(torch.ones(1))
        wrapper.update_params(loss)
    assert steps == [False, False, True, False, False, True, False]
    assert model.forwards == [True, True, False, True, True, False, True]
    assert wrapper.micro_steps == 1
    no_accumulation = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with no_accumulation.optim_context(model):
        model(torch.ones(1))
    assert model.forwards[-1] is False


def test_the_last_micro_steps_of_training_form_a_group_of_their_own():
    """8 iterations with accumulate 3: groups of 3, 3 and 2; the last two steps on their mean
    instead of being left unapplied. Resuming at iteration 7 knows it is in the tail."""
    torch.manual_seed(0)
    model, reference = ToyModel(dropout=0.0), ToyModel(dropout=0.0)
    reference.load_state_dict(model.state_dict())
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    wrapper.set_total(0, 8)
    steps = []
    for micro in range(8):
        steps.append(wrapper.will_step)
        model.train_step(batch_of(micro), wrapper)
    assert steps == [False, False, True, False, False, True, False, True]
    assert wrapper.micro_steps == 0
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for group in ([0, 1, 2], [3, 4, 5], [6, 7]):
        (sum(reference(batch_of(m))["loss"] for m in group) / len(group)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.allclose(flat_params(model), flat_params(reference), atol=1e-6)
    resumed = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    resumed.set_total(7, 8)
    resumed.micro_steps = 1
    assert resumed.group_size() == 2 and resumed.will_step


def test_accumulation_steps_once_on_the_mean_of_the_micro_batches():
    torch.manual_seed(0)
    model, reference = ToyModel(dropout=0.0), ToyModel(dropout=0.0)
    reference.load_state_dict(model.state_dict())
    start = flat_params(model)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    seen = []
    for micro in range(3):
        logged = model.train_step(batch_of(micro), wrapper)
        assert logged["loss"].item() == pytest.approx(reference(batch_of(micro))["loss"].item())
        seen.append((flat_params(model), [p.grad is None for p in model.parameters()]))
    for params, _ in seen[:2]:
        assert torch.equal(params, start)  # no step before the third micro-step
    assert seen[0][1] == [False] * 4 and seen[2][1] == [True] * 4  # zeroed after the step
    (sum(reference(batch_of(m))["loss"] for m in range(3)) / 3).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    assert torch.allclose(flat_params(model), flat_params(reference), atol=1e-6)
    assert wrapper.micro_steps == 0


def _ddp_accumulation_body(accumulate):
    """Count DDP's gradient all-reduces with a comm hook while accumulating."""
    rank, world = dist.get_dist_info()
    torch.manual_seed(0)
    model = MMDistributedDataParallel(ToyModel(dropout=0.0))
    reference = ToyModel(dropout=0.0)
    reference.load_state_dict(model.module.state_dict())
    start = flat_params(model.module)
    reduces: list[int] = []

    def counting_hook(state, bucket):
        reduces.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    wrapper = OptimWrapper(torch.optim.SGD(model.module.parameters(), lr=0.1),
                           accumulate=accumulate)
    record = []
    for micro in range(accumulate):
        model.train_step(batch_of(10 * rank + micro), wrapper)
        grads = flat_grads(model.module) if micro < accumulate - 1 else None
        record.append((len(reduces), grads, torch.equal(flat_params(model.module), start)))

    losses = [reference(batch_of(10 * r + m))["loss"] for r in range(world)
              for m in range(accumulate)]
    (sum(losses) / len(losses)).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    result = record, flat_params(model.module), flat_params(reference)
    del model, wrapper
    gc.collect()
    return result


def test_ddp_accumulation_all_reduces_only_on_the_stepping_micro_step(run_on):
    (record0, after0, expected), (record1, after1, _) = run_on(2)(_ddp_accumulation_body, 3)
    for record in (record0, record1):
        assert [count for count, _, _ in record] == [0, 0, 1]  # one bucket, once
        assert [unchanged for _, _, unchanged in record] == [True, True, False]
    for micro in range(2):  # the accumulated gradients stayed local
        assert not torch.equal(record0[micro][1], record1[micro][1])
    assert torch.equal(after0, after1)
    assert torch.allclose(after0, expected, atol=1e-6)


# ---------------------------------------------------------------- clipping


def _one_param_step(wrapper_options, grad, lr=1.0):
    p = nn.Parameter(torch.zeros(len(grad)))
    wrapper = OptimWrapper(torch.optim.SGD([p], lr=lr), **wrapper_options)
    with wrapper.optim_context(nn.Module()):
        loss = (p * torch.tensor(grad)).sum()
    wrapper.update_params(loss)
    return p.detach(), wrapper


@pytest.mark.parametrize(("clip_grad", "norm", "scale"), [
    (5.0, 50.0, 5.0 / 50.0),  # a max norm: the L2 norm 50 clipped to 5
    ({"max_norm": 7.0, "norm_type": 1.0}, 70.0, 7.0 / 70.0),  # the L1 norm 70 clipped to 7
    (100.0, 50.0, 1.0),  # below the limit: unchanged
])
def test_clip_grad(clip_grad, norm, scale):
    p, wrapper = _one_param_step({"clip_grad": clip_grad}, [30.0, 40.0, 0.0])
    assert wrapper.grad_norm.item() == pytest.approx(norm)
    assert p.tolist() == pytest.approx([-30.0 * scale, -40.0 * scale, 0.0], rel=1e-5)


def test_clip_grad_by_value_steps_as_torchs_clip_grad_value():
    """Steps of a wrapper clipping by value against hand-made ones: backward, torch's
    clip_grad_value_, step; the same parameters to the bit."""
    torch.manual_seed(0)
    model, reference = ToyModel(dropout=0.0), ToyModel(dropout=0.0)
    reference.load_state_dict(model.state_dict())
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           clip_grad={"clip_value": 0.05})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        batch = batch_of(step)
        with wrapper.optim_context(model):
            loss = model(batch)["loss"]
        wrapper.update_params(loss)
        reference(batch)["loss"].backward()
        raw = flat_grads(reference)
        nn.utils.clip_grad_value_(reference.parameters(), clip_value=0.05)
        clipped = flat_grads(reference)
        assert raw.abs().max() > 0.05 and clipped.abs().max() == 0.05  # clipping bit
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert torch.equal(flat_params(model), flat_params(reference)), step


def test_clip_grad_by_value_measures_the_norm_before_clipping_on_request_only():
    p, wrapper = _one_param_step({"clip_grad": {"clip_value": 35.0}}, [30.0, 40.0, -50.0])
    assert p.tolist() == [-30.0, -35.0, 35.0]  # each value clipped to [-35, 35]
    assert wrapper.grad_norm is None  # no norm to clip: none measured
    p = nn.Parameter(torch.zeros(3))
    wrapper = OptimWrapper(torch.optim.SGD([p], lr=1.0), clip_grad={"clip_value": 35.0})
    measure_grad_norm(wrapper, True)  # what the logger asks on the steps it logs
    wrapper.update_params((p * torch.tensor([30.0, 40.0, 0.0])).sum())
    assert grad_norms(wrapper)["grad_norm"].item() == pytest.approx(50.0)  # not 46.1 (clipped)
    assert p.tolist() == [-30.0, -35.0, 0.0]


def test_no_clipping_by_default():
    p, wrapper = _one_param_step({}, [30.0, 40.0, 0.0])
    assert wrapper.grad_norm is None and p.tolist() == [-30.0, -40.0, 0.0]


def test_the_grad_norm_is_measured_on_request_on_steps_that_step_only():
    """What the logger asks for on logged steps: the norm of the gradient the step applies
    (accumulated: the group's mean), none after a micro-step that only accumulated."""
    p = nn.Parameter(torch.zeros(2))
    wrapper = OptimWrapper(torch.optim.SGD([p], lr=1.0), accumulate=2)
    norms = []
    for measure in (True, True, False, False):
        measure_grad_norm(wrapper, measure)
        wrapper.update_params((p * torch.tensor([6.0, 8.0])).sum())
        norms.append(grad_norms(wrapper).get("grad_norm"))
    assert norms[0] is None and norms[1].item() == 10.0 and norms[2:] == [None, None]
    assert p.tolist() == [-12.0, -16.0]  # measuring changed nothing


def test_grad_norms_of_a_dict_of_wrappers_name_each():
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    wrappers = OptimWrapperDict(gen=OptimWrapper(torch.optim.SGD([a], lr=1.0)),
                                disc=OptimWrapper(torch.optim.SGD([b], lr=1.0), clip_grad=1.0))
    measure_grad_norm(wrappers, True)
    wrappers["gen"].update_params(3.0 * a.sum())
    wrappers["disc"].update_params(-4.0 * b.sum())
    assert {k: v.item() for k, v in grad_norms(wrappers).items()} == {
        "grad_norm/gen": 3.0, "grad_norm/disc": 4.0}  # disc's before clipping
    assert grad_norms(object()) == {}  # a wrapper that measures none


# ---------------------------------------------------------------- mixed precision


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32),
                                                  ("bf16", torch.bfloat16),
                                                  ("fp16", torch.float16)])
def test_optim_context_autocasts_to_the_precision(precision, dtype):
    layer = nn.Linear(4, 2)
    wrapper = OptimWrapper(torch.optim.SGD(layer.parameters(), lr=0.1), precision=precision)
    with wrapper.optim_context(layer):
        inside = layer(torch.randn(3, 4))
    outside = layer(torch.randn(3, 4))
    assert inside.dtype == dtype and outside.dtype == torch.float32
    assert (wrapper.scaler is not None) == (precision == "fp16")
    assert layer.weight.dtype == torch.float32  # the weights stay fp32


def test_fp16_scales_the_loss_and_unscales_before_clipping_and_stepping():
    p, wrapper = _one_param_step({"precision": "fp16", "clip_grad": 5.0}, [30.0, 40.0, 0.0],
                                 lr=0.5)
    assert wrapper.grad_norm.item() == pytest.approx(50.0)  # the true norm, not a scaled one
    assert p.tolist() == pytest.approx([-0.5 * 3.0, -0.5 * 4.0, 0.0], rel=1e-4)
    assert wrapper.scaler.get_scale() == 2.0 ** 16  # a good step keeps the scale


def test_fp16_unscales_before_clipping_by_value():
    """Clipped while scaled (by 2**16), every value would be cut to the bound and then
    divided by the scale."""
    p, wrapper = _one_param_step({"precision": "fp16", "clip_grad": {"clip_value": 35.0}},
                                 [30.0, 40.0, 0.0])
    assert p.tolist() == pytest.approx([-30.0, -35.0, 0.0], rel=1e-4)
    assert wrapper.scaler.get_scale() == 2.0 ** 16


def test_fp16_skips_a_step_with_infinite_gradients_and_backs_off():
    p = nn.Parameter(torch.ones(2))
    wrapper = OptimWrapper(torch.optim.SGD([p], lr=0.1), precision="fp16")
    wrapper.update_params((p * torch.tensor([math.inf, 1.0])).sum())
    assert p.tolist() == [1.0, 1.0]  # skipped
    assert wrapper.scaler.get_scale() == 2.0 ** 15
    wrapper.update_params((p * torch.tensor([1.0, 2.0])).sum())
    assert p.tolist() == pytest.approx([0.9, 0.8])


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16; got 'fp8'"):
        OptimWrapper(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), precision="fp8")


# ---------------------------------------------------------------- state


def test_wrapper_state_round_trip(tmp_path):
    p = nn.Parameter(torch.ones(2))
    wrapper = OptimWrapper(torch.optim.SGD([p], lr=0.25), accumulate=4, precision="fp16")
    wrapper.update_params((p * torch.tensor([math.inf, 1.0])).sum())  # inf: that step skips
    for _ in range(5):
        wrapper.update_params(p.sum())
    state = wrapper.state_dict()
    assert state["micro_steps"] == 2 and state["scaler"]["scale"] == 2.0 ** 15
    # the two micro-steps' (scaled) gradients, a copy: the next backward must not change it
    assert [g.tolist() for g in state["grads"]] == [[2 * 2.0**15 / 4] * 2]
    assert state["grads"][0] is not p.grad
    assert wrapper.get_lr() == 0.25
    torch.save(state, tmp_path / "wrapper.pth")
    state = torch.load(tmp_path / "wrapper.pth", weights_only=True)

    q = nn.Parameter(torch.ones(2))
    fresh = OptimWrapper(torch.optim.SGD([q], lr=0.25), accumulate=4, precision="fp16")
    fresh.load_state_dict(state)
    assert fresh.micro_steps == 2 and fresh.scaler.get_scale() == wrapper.scaler.get_scale()
    assert fresh.will_step is False
    # both finish the accumulation the same way
    for w, param in ((wrapper, p), (fresh, q)):
        for _ in range(2):
            w.update_params(param.sum())
    assert torch.equal(q, p) and q.tolist() != [1.0, 1.0]
    assert OptimWrapper(torch.optim.SGD([p], lr=1.0)).state_dict() == {
        "micro_steps": 0, "scaler": None, "grads": None}


def test_optim_wrapper_dict():
    g, d = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    wrappers = OptimWrapperDict(generator=OptimWrapper(torch.optim.SGD([g], lr=0.1)),
                                discriminator=OptimWrapper(torch.optim.SGD([d], lr=0.2),
                                                           accumulate=2))
    assert wrappers.get_lr() == 0.1
    wrappers["discriminator"].update_params(d.sum())
    state = wrappers.state_dict()
    assert set(state) == {"generator", "discriminator"}
    assert state["generator"] == {"micro_steps": 0, "scaler": None, "grads": None}
    assert state["discriminator"]["micro_steps"] == 1
    assert [g.tolist() for g in state["discriminator"]["grads"]] == [[0.5]]  # 1 / accumulate
    fresh = OptimWrapperDict(generator=OptimWrapper(torch.optim.SGD([g], lr=0.1)),
                             discriminator=OptimWrapper(torch.optim.SGD([d], lr=0.2),
                                                        accumulate=2))
    d.grad = None
    fresh.load_state_dict(state)
    assert fresh["discriminator"].micro_steps == 1 and fresh["discriminator"].will_step
    assert d.grad.tolist() == [0.5] and g.grad is None
