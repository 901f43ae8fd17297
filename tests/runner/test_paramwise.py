"""optim.paramwise: which rule gives each parameter its rates, how parameters are grouped and
in what order, the section's checks, per-module optimisers, the unmatched-key warning and the
groups counted on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.runner.toy import NormToy, ToyModel
from trainrun.runner.config import ConfigError, check
from trainrun.runner.optim import optimizer_factory
from trainrun.runner.optim.param_groups import describe_groups, param_groups
from trainrun.runner.optim.section import check_optim_section
from trainrun.runner.plan import plan_param_groups
from trainrun.wrappers import BaseModel


class MyNorm(nn.LayerNorm):
    """A user's own normalisation layer: a subclass counts as one."""


class Zoo(nn.Module):
    """One of every normalisation layer, a tied weight, a frozen layer and a conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm1d(4, affine=True)
        self.ln = MyNorm(4)
        self.rms = nn.RMSNorm(4)
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10)
        self.out.weight = self.emb.weight  # tied: one parameter, under its first name
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def _paramwise(**given):
    return check_optim_section("optim", {"type": "AdamW", "lr": 0.1, "weight_decay": 0.01,
                                         "paramwise": given})["paramwise"]


def _table(module, **given):
    groups, unmatched = param_groups(module, 0.1, 0.01, _paramwise(**given))
    return [(g.name, g.lr, g.weight_decay, g.names) for g in groups], unmatched


def test_rules_bias_norm_and_custom_keys_longest_first():
    groups, unmatched = _table(
        Zoo(), bias_lr_mult=2, bias_decay_mult=0.5, norm_decay_mult=0,
        custom_keys={"frozen": {"lr_mult": 0.1}, "frozen.bias": {"lr_mult": 4, "decay_mult": 0},
                     "nowhere": {}})
    assert groups == [
        ("default", 0.1, 0.01, ["conv.weight", "emb.weight"]),
        ("bias", 0.2, 0.005, ["conv.bias", "out.bias"]),
        ("norm", 0.1, 0.0, ["bn.weight", "bn.bias", "gn.weight", "gn.bias", "inorm.weight",
                            "inorm.bias", "ln.weight", "ln.bias", "rms.weight"]),
        # the longer key wins for frozen.bias, and custom keys leave bias rules out
        ("'frozen'", 0.1 * 0.1, 0.01, ["frozen.weight"]),
        ("'frozen.bias'", 0.1 * 4, 0.0, ["frozen.bias"]),
    ]
    assert unmatched == ["nowhere"]


def test_same_rates_share_a_group_and_the_base_group_comes_first():
    # bias_lr_mult 1 and bias_decay_mult 1: biases end at the base rates, in the base group
    groups, _ = _table(NormToy(), bias_lr_mult=1, bias_decay_mult=1,
                       custom_keys={"embed": {"lr_mult": 3}})
    assert groups == [("default + bias", 0.1, 0.01, ["norm.weight", "norm.bias",
                                                     "head.1.weight", "head.1.bias"]),
                      ("'embed'", 0.1 * 3, 0.01, ["embed.weight", "embed.bias"])]
    # a norm layer's bias: norm_decay_mult when set, else bias_decay_mult; never bias_lr_mult
    groups, _ = _table(NormToy(), bias_lr_mult=5, bias_decay_mult=0)
    assert groups[0][0] == "default" and ("bias", 0.1 * 5, 0.0, ["embed.bias", "head.1.bias"]) \
        in groups and ("bias", 0.1, 0.0, ["norm.bias"]) in groups


def test_no_paramwise_is_one_group_as_before_and_empty_is_the_base_rates():
    model = ToyModel()
    plain = optimizer_factory(check_optim_section("optim", {"type": "SGD", "lr": 0.1}))(model)
    assert len(plain.param_groups) == 1 and "name" not in plain.param_groups[0]
    empty = optimizer_factory(check_optim_section(
        "optim", {"type": "SGD", "lr": 0.1, "paramwise": {}}))(model)
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in empty.param_groups] == \
        [("default", 0.1, 0.0)]
    assert list(empty.param_groups[0]["params"]) == list(model.parameters())


def test_the_order_is_the_same_on_every_build():
    orders = {tuple(tuple(g[3]) for g in _table(Zoo(), bias_lr_mult=2, norm_decay_mult=0,
                                                 custom_keys={"e": {}, "o": {}})[0])
              for _ in range(3)}
    assert len(orders) == 1


@pytest.mark.parametrize(("paramwise", "words"), [
    ({"bias_lr_mult": -1}, "optim.paramwise.bias_lr_mult: got -1, expected null or a number >= 0"),
    ({"bias_decay_mult": "x"}, "optim.paramwise.bias_decay_mult: got 'x'"),
    ({"norm_decay_mult": True}, "optim.paramwise.norm_decay_mult: got true"),
    ({"norm_decay_mul": 0}, "unknown key 'optim.paramwise.norm_decay_mul'; did you mean "
                            "'optim.paramwise.norm_decay_mult'?"),
    ({"custom_keys": [1]}, "optim.paramwise.custom_keys: got [1], expected a mapping"),
    ({"custom_keys": {"head": {"lr_mult": -0.5}}},
     "optim.paramwise.custom_keys.head.lr_mult: got -0.5, expected a number >= 0"),
    ({"custom_keys": {"head": {"decay_mul": 0}}},
     "unknown key 'optim.paramwise.custom_keys.head.decay_mul'; did you mean "
     "'optim.paramwise.custom_keys.head.decay_mult'?"),
    ({"custom_keys": {"head": 3}}, "optim.paramwise.custom_keys.head: got 3, expected a mapping"),
    ({"custom_keys": {"": {}}}, "optim.paramwise.custom_keys: got ''"),
    ("yes", "optim.paramwise: got 'yes', expected null or a mapping"),
])
def test_bad_values_name_their_key(paramwise, words):
    with pytest.raises(ConfigError) as error:
        check_optim_section("optim", {"type": "AdamW", "paramwise": paramwise})
    assert words in str(error.value)
    assert "\n" not in str(error.value)


def test_a_misspelt_paramwise_and_decay_mults_without_weight_decay_are_refused():
    with pytest.raises(ConfigError, match="did you mean 'optim.paramwise'"):
        check_optim_section("optim", {"type": "AdamW", "param_wise": {}})
    with pytest.raises(ConfigError, match="optim.paramwise.custom_keys.a.decay_mult: the "
                                          "optimiser takes no weight_decay"):
        check_optim_section("optim", {"type": "SparseAdam", "lr": 1,
                                      "paramwise": {"custom_keys": {"a": {"decay_mult": 0}}}})
    with pytest.raises(ConfigError, match=r"optim.paramwise: got \{\}, expected null: LBFGS "
                                          "takes one parameter group"):
        check_optim_section("optim", {"type": "LBFGS", "paramwise": {}})
    out = check_optim_section("optim", {"type": "SparseAdam", "lr": 1,
                                        "paramwise": {"bias_lr_mult": 0.5}})
    optimizer = optimizer_factory(out)(ToyModel())
    assert [("weight_decay" in g, g["lr"]) for g in optimizer.param_groups] == \
        [(False, 1), (False, 0.5)]


def test_a_key_matching_nothing_is_a_warning_naming_it():
    said = []
    optim = check_optim_section("optim", {"type": "AdamW", "paramwise": {
        "custom_keys": {"net.0": {"lr_mult": 2}, "backbone": {"lr_mult": 0.1}}}})
    optimizer_factory(optim, said.append)(ToyModel())
    assert said == ["optim.paramwise.custom_keys.backbone: matches no parameter of the model "
                    "(a key is a part of a parameter's full name); it changes nothing"]


class Pair(BaseModel):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.b = nn.Linear(4, 1)


def test_per_module_optimisers_group_under_full_names_and_may_override():
    said, told = [], []
    optim = check_optim_section("optim", {
        "type": "SGD", "lr": 0.1, "weight_decay": 0.01,
        "paramwise": {"norm_decay_mult": 0, "custom_keys": {"a.0": {"lr_mult": 2},
                                                            "b.bias": {"lr_mult": 3}}},
        "per_module": {"a": None, "b": {"paramwise": {"custom_keys": {"a.1": {}}}}}})
    optimizers = optimizer_factory(optim, said.append, told.extend)(Pair())
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in optimizers["a"].param_groups] == \
        [("'a.0'", 0.2, 0.01), ("norm", 0.1, 0.0)]
    assert [g["name"] for g in optimizers["b"].param_groups] == ["default"]
    # b.bias is in the shared keys, which only a uses: unmatched there; b's own a.1 too
    assert said == [
        "optim.paramwise.custom_keys.b.bias: matches no parameter of the model (a key is a "
        "part of a parameter's full name); it changes nothing",
        "optim.per_module.b.paramwise.custom_keys.a.1: matches no parameter of the model (a "
        "key is a part of a parameter's full name); it changes nothing"]
    assert told[0] == "a: 'a.0': lr 0.2, weight_decay 0.01; 2 tensors, 20 elements"


def test_the_plan_counts_groups_on_the_meta_device():
    cfg, _ = check({"name": "x", "model": {"type": "tests.runner.toy.NormToy"},
                    "data": {"train": {"type": "tests.runner.toy.ToyRegression"}},
                    "optim": {"lr": 0.1, "weight_decay": 0.01,
                              "paramwise": {"norm_decay_mult": 0, "custom_keys": {"zz": {}}}}})
    lines, warnings = plan_param_groups(cfg)
    assert lines == ["default: lr 0.1, weight_decay 0.01; 4 tensors, 49 elements",
                     "norm: lr 0.1, weight_decay 0; 2 tensors, 16 elements"]
    assert warnings and "custom_keys.zz" in warnings[0]
    cfg["model"] = {"type": "tests.runner.test_paramwise.NeedsRealTensors"}
    lines, _ = plan_param_groups(cfg)
    assert lines.startswith("not listed here: the model cannot be built on the meta device")
    cfg["optim"]["paramwise"] = None
    assert plan_param_groups(cfg) == (None, [])


class NeedsRealTensors(NormToy):
    def __init__(self):
        super().__init__()
        self.scale = float(self.embed.weight.abs().max().item())


def test_describe_groups_counts_tensors_and_elements():
    optimizer = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(3, 4))], "lr": 0.5}],
                                lr=0.1)
    assert describe_groups(optimizer, "g") == [
        "g: all parameters: lr 0.5, weight_decay 0; 1 tensor, 12 elements"]


def test_a_min_lr_above_a_groups_rate_is_refused_naming_the_group():
    from trainrun.runner.optim import build_scheduler

    optim = check_optim_section("optim", {"type": "SGD", "lr": 0.1, "paramwise": {
        "custom_keys": {"head": {"lr_mult": 0.01}}}})
    optimizer = optimizer_factory(optim)(NormToy())
    scheduler = {"type": "cosine", "min_lr": 0.01}
    with pytest.raises(ValueError) as error:
        build_scheduler(optimizer, scheduler, 10)
    assert str(error.value) == ("scheduler.min_lr: got 0.01, expected at most the learning "
                                "rate (0.001): the rate of parameter group 'head' "
                                "(optim.paramwise)")
    cfg, _ = check({"name": "x", "model": {"type": "tests.runner.toy.NormToy"},
                    "data": {"train": {"type": "tests.runner.toy.ToyRegression"}},
                    "optim": optim, "scheduler": scheduler, "schedule": {"max_iters": 10}})
    with pytest.raises(ConfigError, match="group 'head'"):
        plan_param_groups(cfg)  # the dry run refuses it too
    cfg["scheduler"]["min_lr"] = 0.0005
    assert len(plan_param_groups(cfg)[0]) == 2
