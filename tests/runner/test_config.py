"""Config loading: YAML safety, overrides, interpolation, defaults and one-line errors."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from trainrun.runner.config import (
    LOADER_KEYS,
    ConfigError,
    dataset_kwargs,
    load_config,
    strategy_options,
)
from trainrun.runner.optim import optimizer_factory, wrap_optimizers

MINIMAL = """\
model: {type: digits_mlp}
data:
  train: {type: digits}
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str = MINIMAL, overrides=(), **kwargs) -> DictConfig:
    return load_config(write(tmp_path, text), overrides, **kwargs)


def error(tmp_path: Path, text: str = MINIMAL, overrides=(), **kwargs) -> str:
    """The message of the ConfigError that loading raises; it must be one line."""
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, overrides, **kwargs)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- defaults and shape

def test_minimal_config_gets_every_default(tmp_path):
    cfg = load(tmp_path)
    plain = OmegaConf.to_container(cfg)
    assert plain["name"] == "run"  # the file's stem
    assert plain["work_dir"] == "work_dirs/run"
    assert (plain["launcher"], plain["backend"], plain["dist_timeout"]) == ("none", "auto", 1800)
    assert plain["strategy"]["type"] == "ddp"
    assert plain["strategy"]["find_unused_parameters"] is False
    assert plain["model"] == {"type": "digits_mlp"}
    assert plain["data"] == {
        "train": {"type": "digits", "batch_size": 32, "num_workers": 0, "shuffle": True,
                  "drop_last": False, "pin_memory": False, "persistent_workers": False},
        "val": None, "test": None,
    }
    assert plain["optim"] == {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.0,
                              "clip_grad": None, "accumulate": 1, "per_module": None}
    assert plain["scheduler"] is None
    assert plain["precision"] == "fp32"
    assert plain["schedule"] == {"max_epochs": 10, "max_iters": None, "val_interval": 1,
                                 "val_begin": 1}
    assert plain["randomness"] == {"seed": 42, "deterministic": False, "diff_rank_seed": False}
    assert plain["logging"] == {"interval": 10, "backends": ["console", "jsonl"],
                                "step_metrics": True, "window": 1, "straggler_floor": 0.01}
    assert plain["checkpoint"] == {"interval": 1, "max_keep": 3, "save_last": True,
                                   "save_best": None, "best_rule": None, "async": False}
    assert plain["guard"] == {"nonfinite": "stop", "spike": None, "skip_batches": 200,
                              "max_rollbacks": 3}
    assert plain["resume"] is False
    assert plain["load_from"] is None


def test_val_and_test_sections_do_not_shuffle_and_carry_metrics(tmp_path):
    cfg = load(tmp_path, MINIMAL + "  val: {type: digits, metrics: [accuracy]}\n"
                                   "  test: {type: digits, split: test}\n")
    assert cfg.data.val.shuffle is False and cfg.data.test.shuffle is False
    assert list(cfg.data.val.metrics) == ["accuracy"]
    assert cfg.data.test.metrics is None  # the data set's default metrics
    assert "metrics" not in cfg.data.train


def test_name_in_file_wins_over_stem_and_feeds_work_dir(tmp_path):
    cfg = load(tmp_path, "name: exp1\n" + MINIMAL)
    assert (cfg.name, cfg.work_dir) == ("exp1", "work_dirs/exp1")


def test_loaded_config_round_trips_through_yaml(tmp_path):
    text = MINIMAL + """\
optim: {type: SGD, lr: 0.1, momentum: 0.9, clip_grad: 2.0}
scheduler: {type: cosine, warmup_iters: 5}
schedule: {max_iters: 100}
checkpoint: {save_best: accuracy}
"""
    cfg = load(tmp_path, text)
    again = load_config(write(tmp_path, OmegaConf.to_yaml(cfg), "config.yaml"))
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


def test_test_mode_needs_data_test_but_not_train(tmp_path):
    assert "data.test: missing" in error(tmp_path, MINIMAL, mode="test")
    cfg = load(tmp_path, "model: {type: m}\ndata: {test: {type: d}}\n", mode="test")
    assert cfg.data.train is None and cfg.data.test.type == "d"


# ---------------------------------------------------------------- overrides and interpolation

def test_dotlist_overrides_are_typed_and_merged(tmp_path):
    cfg = load(tmp_path, overrides=["optim.lr=0.01", "strategy.type=none",
                                    "logging.backends=[console]", "schedule.max_epochs=3",
                                    "data.train.batch_size=8", "model.hidden=128"])
    assert cfg.optim.lr == 0.01
    assert cfg.strategy.type == "none"
    assert list(cfg.logging.backends) == ["console"]
    assert cfg.schedule.max_epochs == 3
    assert cfg.data.train.batch_size == 8
    assert cfg.model.hidden == 128


HOOKED = MINIMAL + """\
hooks:
  - {type: EMA, momentum: 0.05, warmup: 20}
  - {type: EarlyStopping, metric: accuracy, patience: 2}
"""


def test_an_override_goes_into_a_list_by_index(tmp_path):
    """As MMEngine's --cfg-options does: ``hooks.1.patience=5`` changes the second hook and
    keeps the rest of it; ``hooks.0={...}`` merges into the first."""
    cfg = load(tmp_path, HOOKED, overrides=["hooks.1.patience=5",
                                            "hooks.0={momentum: 0.2, interval: 2}"])
    ema, stopping = OmegaConf.to_container(cfg.hooks)
    assert (ema["type"], ema["momentum"], ema["warmup"], ema["interval"]) == ("EMA", 0.2, 20, 2)
    assert (stopping["type"], stopping["metric"], stopping["patience"]) == (
        "EarlyStopping", "accuracy", 5)


@pytest.mark.parametrize(("override", "said"), [
    ("hooks.2.patience=5", "hooks is a list of 2: expected an index from 0 to 1 after "
                           "'hooks.', got '2'"),
    ("hooks.first.patience=5", "got 'first'"),
    ("hooks.-1.patience=5", "got '-1'"),
])
def test_an_index_that_is_not_the_lists_names_the_override(tmp_path, override, said):
    message = error(tmp_path, HOOKED, overrides=[override])
    assert message.startswith(f"override {override!r}: ") and said in message, message


def test_overrides_can_swap_the_schedule_and_add_a_scheduler(tmp_path):
    text = MINIMAL + "schedule: {max_epochs: 5}\n"
    cfg = load(tmp_path, text, ["schedule.max_epochs=null", "schedule.max_iters=50",
                                "scheduler.type=step", "scheduler.step_size=10"])
    assert (cfg.schedule.max_epochs, cfg.schedule.max_iters) == (None, 50)
    assert cfg.scheduler.type == "step" and cfg.scheduler.gamma == 0.1


@pytest.mark.parametrize(("in_file", "given", "replaced", "unit"), [
    ("max_epochs: 5", "max_iters=50", "max_epochs", "iterations"),
    ("max_iters: 50", "max_epochs=5", "max_iters", "epochs"),
])
def test_a_length_on_the_command_line_replaces_the_files_other_one(tmp_path, in_file, given,
                                                                   replaced, unit):
    warnings: list[str] = []
    cfg = load(tmp_path, MINIMAL + f"schedule: {{{in_file}}}\n", [f"schedule.{given}"],
               on_warning=warnings.append)
    key, value = given.split("=")
    assert cfg.schedule[key] == int(value) and cfg.schedule[replaced] is None
    assert warnings == [f"schedule.{given} on the command line replaces the config file's "
                        f"schedule.{replaced} ({in_file.split(': ')[1]}); "
                        f"schedule.val_interval and checkpoint.interval now count {unit}"]
    # both in the file stay an error, as both on the command line do
    both = MINIMAL + "schedule: {max_epochs: 5, max_iters: 50}\n"
    assert "got both max_epochs (5) and max_iters (50)" in error(tmp_path, both)
    assert "got both" in error(tmp_path, MINIMAL, ["schedule.max_epochs=2",
                                                   "schedule.max_iters=9"])


@pytest.mark.parametrize(("metric", "rule"), [("accuracy", "greater"), ("val_loss", "less"),
                                              ("Val_Loss", "less"), ("LOSS", "less")])
def test_the_best_checkpoint_rule_reads_loss_in_any_case(tmp_path, metric, rule):
    from trainrun.runner.hooks.checkpoint import CheckpointHook

    cfg = load(tmp_path, MINIMAL, [f"checkpoint.save_best={metric}"])
    assert cfg.checkpoint.best_rule == rule  # what the config fills in, and what the hook
    assert CheckpointHook(save_best=metric).greater == (rule == "greater")  # alone decides


def test_command_line_values_win_over_overrides(tmp_path):
    cfg = load(tmp_path, "launcher: slurm\n" + MINIMAL, ["launcher=mpi"],
               values={"launcher": "pytorch", "work_dir": "out/${name}"})
    assert cfg.launcher == "pytorch"
    assert cfg.work_dir == "out/run"


def test_interpolation_is_resolved_after_overrides(tmp_path):
    text = MINIMAL + """\
name: base
work_dir: runs/${name}/lr_${optim.lr}
optim: {lr: 0.1}
scheduler: {type: cosine, min_lr: "${optim.lr}"}
"""
    cfg = load(tmp_path, text, ["optim.lr=0.5", "name=tuned"])
    assert cfg.work_dir == "runs/tuned/lr_0.5"
    assert cfg.scheduler.min_lr == 0.5
    assert "${" not in OmegaConf.to_yaml(cfg)


def test_environment_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINRUN_TEST_ROOT", "/scratch")
    cfg = load(tmp_path, MINIMAL + "work_dir: ${oc.env:TRAINRUN_TEST_ROOT}/x\n")
    assert cfg.work_dir == "/scratch/x"


def test_interpolation_of_a_missing_key_names_the_key(tmp_path):
    message = error(tmp_path, MINIMAL + "work_dir: out/${optim.learning_rate}\n")
    assert message.startswith("work_dir:") and "optim.learning_rate" in message


def test_a_name_whose_interpolation_fails_is_a_config_error(tmp_path):
    """``name`` is read before the rest is resolved (to fill it from the file's stem): a
    missing key in it was a traceback from OmegaConf, not the one line."""
    message = error(tmp_path, MINIMAL, overrides=["name=x-${optim.learning_rate}"])
    assert "optim.learning_rate" in message


def test_bad_interpolation_syntax_names_the_key(tmp_path):
    assert "work_dir" in error(tmp_path, MINIMAL + "work_dir: out/${name\n")


@pytest.mark.parametrize("override", ["optim.lr", "=1", "a..b=1", ".a=1", "a.=1", "a=[1, 2"])
def test_bad_override_syntax_names_the_override(tmp_path, override):
    assert f"override {override!r}" in error(tmp_path, overrides=[override])


# ---------------------------------------------------------------- files and YAML

def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path)  # a directory


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    message = error(tmp_path, "model: {type: m}\ndata:\n  train: [1, 2\n  x: 3\n")
    assert "run.yaml:4:" in message


def test_yaml_indentation_error_names_the_line(tmp_path):
    assert "run.yaml:3:" in error(tmp_path, "model:\n  type: m\n   hidden: 2\n")


def test_duplicate_keys_are_an_error(tmp_path):
    message = error(tmp_path, MINIMAL + "name: a\nname: b\n")
    assert "run.yaml:5:" in message and "duplicate key" in message


def test_python_tags_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    text = MINIMAL + f"name: !!python/object/apply:os.system ['touch {marker}']\n"
    message = error(tmp_path, text)
    assert "run.yaml:4:" in message and "python/object/apply" in message
    assert "not allowed" in message
    assert not marker.exists()


def test_python_tags_in_overrides_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    override = f"name=!!python/object/apply:os.system ['touch {marker}']"
    assert "override" in error(tmp_path, overrides=[override])
    assert not marker.exists()


def test_a_list_at_the_top_level_is_an_error(tmp_path):
    assert "expected a mapping" in error(tmp_path, "- 1\n- 2\n")


def test_an_empty_file_misses_model(tmp_path):
    assert error(tmp_path, "").startswith("model: missing")


# ---------------------------------------------------------------- rejected values

BAD_OVERRIDES = [
    # (overrides, the start of the message)
    (["launcher=torchrun"], "launcher: got 'torchrun', expected one of none, pytorch, slurm, "
                            "mpi; did you mean 'pytorch'?"),
    (["backend=ncll"], "backend: got 'ncll', expected one of auto, nccl, gloo, mpi; "
                       "did you mean 'nccl'?"),
    (["dist_timeout=0"], "dist_timeout: got 0, expected a number > 0"),
    (["dist_timeout=soon"], "dist_timeout: got 'soon', expected a number > 0"),
    (["name=''"], "name: got '', expected a non-empty string"),
    (["work_dir=3"], "work_dir: got 3, expected null or a non-empty string"),
    (["strategy.type=dpp"], "strategy.type: got 'dpp', expected one of"),
    (["strategy.bucket_capmb=5"], "unknown key 'strategy.bucket_capmb'; "
                                  "did you mean 'strategy.bucket_cap_mb'?"),
    (["strategy.wibble=1"], "unknown key 'strategy.wibble'; expected one of type,"),
    (["model.type=''"], "model.type: got '', expected a non-empty string"),
    (["model=null"], "model.type: missing"),
    (["model=resnet"], "model: got 'resnet', expected a mapping"),
    (["data.train.batch_size=0"], "data.train.batch_size: got 0, expected an int >= 1"),
    (["data.train.batch_size=1.5"], "data.train.batch_size: got 1.5, expected an int >= 1"),
    (["data.train.batch_size=true"], "data.train.batch_size: got true, expected an int >= 1"),
    (["data.train.num_workers=-1"], "data.train.num_workers: got -1, expected an int >= 0"),
    (["data.train.shuffle=maybe"], "data.train.shuffle: got 'maybe', expected true or false"),
    (["data.train.persistent_workers=true"],
     "data.train.persistent_workers: got true, expected false when data.train.num_workers is 0"),
    (["data.train.metrics=[accuracy]"], "data.train.metrics: got ['accuracy'], expected no "
                                        "metrics on the train section"),
    (["data.train.type=null"], "data.train.type: got null, expected a non-empty string"),
    (["data.val.type=digits", "data.val.metrics=accuracy"],
     "data.val.metrics: got 'accuracy', expected null or a list of a non-empty string"),
    (["data.val.type=digits", "data.val.metrics=[accuracy, '']"],
     "data.val.metrics[1]: got '', expected a non-empty string"),
    (["data.val.batch_size=4"], "data.val.type: missing"),
    (["data.tain.type=d"], "unknown key 'data.tain'; did you mean 'data.train'?"),
    (["data=[1]"], "override 'data=[1]': Cannot merge"),
    (["data.train=[1]"], "override 'data.train=[1]': Cannot merge"),
    (["optim.type=adamw"], "optim.type: got 'adamw', expected one of"),
    (["optim.lr=-0.1"], "optim.lr: got -0.1, expected a number > 0"),
    (["optim.lr=0"], "optim.lr: got 0, expected a number > 0"),
    (["optim.learnig_rate=0.1"], "unknown key 'optim.learnig_rate'; did you mean 'optim.lr'?"),
    (["optim.betaz=[0.9,0.99]"], "unknown key 'optim.betaz'; did you mean 'optim.betas'?"),
    (["optim.wibble=1"], "unknown key 'optim.wibble'; AdamW takes "),
    (["optim.weight_decay=-1"], "optim.weight_decay: got -1, expected a number >= 0"),
    (["optim.type=LBFGS", "optim.weight_decay=0.1"], "unknown key 'optim.weight_decay'"),
    (["optim.clip_grad=0"], "optim.clip_grad.max_norm: got 0, expected a number > 0"),
    (["optim.clip_grad=big"], "optim.clip_grad: got 'big', expected null, a number > 0, "
                              "{max_norm: ..., norm_type: ...} or {clip_value: ...}"),
    (["optim.clip_grad.norm_type=2"], "optim.clip_grad.max_norm: missing"),
    (["optim.clip_grad.max_nrom=1"], "unknown key 'optim.clip_grad.max_nrom'; "
                                     "did you mean 'optim.clip_grad.max_norm'?"),
    (["optim.clip_grad.clip_value=0"], "optim.clip_grad.clip_value: got 0, expected a number > 0"),
    (["optim.clip_grad.clip_value=big"],
     "optim.clip_grad.clip_value: got 'big', expected a number > 0"),
    (["optim.clip_grad.clip_valeu=1"], "unknown key 'optim.clip_grad.clip_valeu'; "
                                       "did you mean 'optim.clip_grad.clip_value'?"),
    (["optim.clip_grad.clip_value=1", "optim.clip_grad.norm_type=1"],
     "unknown key 'optim.clip_grad.norm_type'; expected one of clip_value, foreach"),
    (["optim.clip_grad.clip_value=1", "optim.clip_grad.max_norm=2"],
     "optim.clip_grad: got {'clip_value': 1, 'max_norm': 2}, expected max_norm (clip the "
     "norm) or clip_value (clip each value), not both"),
    (["optim.clip_grad.clip_value=1", "optim.clip_grad.foreach=maybe"],
     "optim.clip_grad.foreach: got 'maybe', expected null or true or false"),
    (["optim.accumulate=0"], "optim.accumulate: got 0, expected an int >= 1"),
    (["optim.per_module=[g]"], "optim.per_module: got ['g'], expected null or a mapping"),
    (["optim.per_module.gen.lr=-1"], "optim.per_module.gen.lr: got -1, expected a number > 0"),
    (["optim.type=SGD", "optim.per_module.gen.momentun=0.9"],
     "unknown key 'optim.per_module.gen.momentun'; did you mean "
     "'optim.per_module.gen.momentum'?"),
    (["optim.per_module.gen.type=Adamm"], "optim.per_module.gen.type: got 'Adamm'"),
    (["scheduler.type=cosin"], "scheduler.type: got 'cosin', expected one of"),
    (["scheduler.gamma=0.5"], "scheduler.type: missing"),
    (["scheduler=cosine"], "scheduler: got 'cosine', expected null or a mapping"),
    (["scheduler.type=step"], "scheduler.step_size: missing, expected an int >= 1 "
                              "(iterations) (scheduler 'step' needs it)"),
    (["scheduler.type=cosine", "scheduler.warmup_iter=5"],
     "unknown key 'scheduler.warmup_iter' for scheduler 'cosine'; "
     "did you mean 'scheduler.warmup_iters'?"),
    (["scheduler.type=multistep", "scheduler.milestones=[5,3]"],
     "scheduler.milestones: got [5, 3], expected a list of increasing ints"),
    (["scheduler.type=cosine", "scheduler.min_lr=0", "scheduler.min_lr_ratio=0.1"],
     "scheduler: got both min_lr (0) and min_lr_ratio (0.1), expected at most one"),
    (["scheduler.type=cosine", "scheduler.warmup_iters=200", "schedule.max_iters=100",
      "schedule.max_epochs=null"],
     "scheduler.warmup_iters: got 200, expected fewer than schedule.max_iters (100)"),
    (["precision=fp8"], "precision: got 'fp8', expected one of fp32, bf16, fp16"),
    (["schedule.max_epochs=3", "schedule.max_iters=100"],
     "schedule: got both max_epochs (3) and max_iters (100), expected exactly one"),
    (["schedule.max_epochs=0"], "schedule.max_epochs: got 0, expected null or an int >= 1"),
    (["schedule.val_interval=0"], "schedule.val_interval: got 0, expected an int >= 1"),
    (["schedule.max_epoch=3"], "unknown key 'schedule.max_epoch'; "
                               "did you mean 'schedule.max_epochs'?"),
    (["schedule.epochs=3"], "unknown key 'schedule.epochs'; did you mean 'schedule.max_epochs'?"),
    (["randomness.seed=-1"], "randomness.seed: got -1, expected null or an int in "
                             "[0, 2147483648)"),
    (["randomness.seed=2147483648"], "randomness.seed: got 2147483648"),
    (["randomness.deterministic=1"], "randomness.deterministic: got 1, expected true or false"),
    (["randomness.sed=1"], "unknown key 'randomness.sed'; did you mean 'randomness.seed'?"),
    (["logging.interval=0"], "logging.interval: got 0, expected an int >= 1"),
    (["logging.backends=[wandbb]"], "logging.backends[0]: got 'wandbb', expected one of "
                                    "console, jsonl, tensorboard, wandb, mlflow; did you mean "
                                    "'wandb'?"),
    (["logging.backends=[console,no_such_module.Tracker]"],
     "logging.backends[1]: got 'no_such_module.Tracker', expected a tracker class (start, log, "
     "finish; see trainrun.runner.trackers), importable: No module named 'no_such_module'"),
    (["logging.backends=console"], "logging.backends: got 'console', expected a list of"),
    (["logging.backend=[console]"], "unknown key 'logging.backend'; "
                                    "did you mean 'logging.backends'?"),
    (["logging.step_metrics=some"], "logging.step_metrics: got 'some', expected true or false"),
    (["logging.window=0"], "logging.window: got 0, expected an int >= 1"),
    (["logging.window=x"], "logging.window: got 'x', expected an int >= 1"),
    (["checkpoint.interval=-1"], "checkpoint.interval: got -1, expected an int >= 0"),
    (["checkpoint.max_keep=0"], "checkpoint.max_keep: got 0, expected an int >= 1, or -1"),
    (["checkpoint.save_last=1"], "checkpoint.save_last: got 1, expected true or false"),
    (["checkpoint.save_best=''"], "checkpoint.save_best: got '', expected null or a non-empty"),
    (["checkpoint.best_rule=max"], "checkpoint.best_rule: got 'max', expected null or one of "
                                   "greater, less"),
    (["checkpoint.async=often"], "checkpoint.async: got 'often', expected true or false"),
    (["checkpoint.intervall=2"], "unknown key 'checkpoint.intervall'; "
                                 "did you mean 'checkpoint.interval'?"),
    (["resume=3"], "resume: got 3, expected false, true or a checkpoint path"),
    (["resume=no/such.pth"], "resume: got 'no/such.pth', expected an existing file or directory"),
    (["load_from=no/such.pth"],
     "load_from: got 'no/such.pth', expected null or an existing file or directory"),
    (["wrok_dir=x"], "unknown key 'wrok_dir'; did you mean 'work_dir'?"),
    (["optimizer.lr=1"], "unknown key 'optimizer'; did you mean 'optim'?"),
    (["lr_scheduler.type=step"], "unknown key 'lr_scheduler'; did you mean 'scheduler'?"),
]


@pytest.mark.parametrize("overrides, expected", BAD_OVERRIDES,
                         ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_rejected_configs_name_the_key_in_one_line(tmp_path, overrides, expected):
    message = error(tmp_path, MINIMAL, overrides)
    assert message.startswith(expected), message


def test_bad_values_in_the_file_are_named_the_same_way(tmp_path):
    text = MINIMAL + "checkpoint:\n  max_keep: many\n"
    assert error(tmp_path, text).startswith("checkpoint.max_keep: got 'many'")


def test_closed_sections_must_be_mappings(tmp_path):
    assert error(tmp_path, MINIMAL + "schedule: 10\n").startswith(
        "schedule: got 10, expected a mapping")


def test_existing_resume_and_load_from_paths_pass(tmp_path):
    checkpoint = tmp_path / "epoch_1.pth"
    checkpoint.write_bytes(b"")
    cfg = load(tmp_path, overrides=[f"resume={checkpoint}", f"load_from={checkpoint}"])
    assert cfg.resume == str(checkpoint) and cfg.load_from == str(checkpoint)
    assert load(tmp_path, overrides=["resume=true"]).resume is True
    assert load(tmp_path, overrides=["resume=null"]).resume is False


# ---------------------------------------------------------------- strategy

DDP_CONFIG = MINIMAL + "strategy: {type: ddp, find_unused_parameters: true, bucket_cap_mb: 50}\n"


def test_other_strategies_options_are_dropped_with_one_warning(tmp_path):
    warnings: list[str] = []
    cfg = load(tmp_path, DDP_CONFIG, ["strategy.type=none"], on_warning=warnings.append)
    assert OmegaConf.to_container(cfg.strategy) == {"type": "none"}
    assert sorted(warnings) == [
        "strategy.bucket_cap_mb is a 'ddp' option; ignored for 'none'",
        "strategy.find_unused_parameters is a 'ddp'/'separate_ddp' option; ignored for 'none'",
    ]


def test_switching_strategy_keeps_the_options_they_share(tmp_path):
    warnings: list[str] = []
    cfg = load(tmp_path, DDP_CONFIG, ["strategy.type=separate_ddp"],
               on_warning=warnings.append)
    assert strategy_options(cfg) == {"broadcast_buffers": False, "find_unused_parameters": True}
    assert warnings == ["strategy.bucket_cap_mb is a 'ddp' option; ignored for 'separate_ddp'"]


def test_strategy_warnings_reach_the_trainrun_logger_by_default(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainrun"):
        load(tmp_path, DDP_CONFIG, ["strategy.type=none"])
    assert "ignored for 'none'" in caplog.text


def test_strategy_options_are_the_chosen_strategys_with_defaults(tmp_path):
    cfg = load(tmp_path, DDP_CONFIG)
    options = strategy_options(cfg)
    assert options["find_unused_parameters"] is True and options["bucket_cap_mb"] == 50
    assert options["broadcast_buffers"] is True  # a default
    assert "type" not in options
    assert strategy_options({"strategy": {"type": "none", "bucket_cap_mb": 1}}) == {}


def test_strategy_may_be_given_as_a_name(tmp_path):
    assert load(tmp_path, MINIMAL + "strategy: none\n").strategy.type == "none"


# ---------------------------------------------------------------- optimiser

def _optimizers(optim):
    """What the runner builds from a validated optim section, over a two-part module."""
    module = torch.nn.ModuleDict({"generator": torch.nn.Linear(2, 2),
                                  "discriminator": torch.nn.Linear(2, 1),
                                  "d": torch.nn.Linear(2, 1), "g": torch.nn.Linear(2, 2)})
    plain = optim if isinstance(optim, dict) else OmegaConf.to_container(optim)
    return optimizer_factory(plain)(module)


def _options(optimizer) -> dict:
    return {k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "weight_decay",
                                                                 "momentum", "history_size")}


def test_the_optimiser_gets_its_own_keys_not_the_wrappers(tmp_path):
    text = MINIMAL + "optim: {type: Adam, lr: 2.0e-4, betas: [0.5, 0.999], clip_grad: 1.0, " \
                     "accumulate: 4}\n"
    cfg = load(tmp_path, text)
    optimizer = _optimizers(cfg.optim)
    assert type(optimizer) is torch.optim.Adam
    assert _options(optimizer) == {"lr": 2e-4, "betas": (0.5, 0.999), "weight_decay": 0.0}
    assert OmegaConf.to_container(cfg.optim.clip_grad) == {"max_norm": 1.0, "norm_type": 2.0}
    assert cfg.optim.accumulate == 4


def test_optimisers_without_weight_decay_get_none_filled(tmp_path):
    cfg = load(tmp_path, overrides=["optim.type=LBFGS", "optim.history_size=5"])
    assert "weight_decay" not in cfg.optim
    optimizer = _optimizers(cfg.optim)
    assert type(optimizer) is torch.optim.LBFGS
    assert _options(optimizer) == {"lr": 1e-3, "history_size": 5}


def test_per_module_overrides_merge_with_the_shared_options(tmp_path):
    text = MINIMAL + """\
optim:
  type: Adam
  lr: 2.0e-4
  betas: [0.5, 0.999]
  per_module: {generator: {}, discriminator: {lr: 4.0e-4, clip_grad: 1.0}}
"""
    cfg = load(tmp_path, text)
    assert OmegaConf.to_container(cfg.optim.per_module) == {
        "generator": {},
        "discriminator": {"lr": 4e-4, "clip_grad": {"max_norm": 1.0, "norm_type": 2.0}}}
    optimizers = _optimizers(cfg.optim)
    assert set(optimizers) == {"generator", "discriminator"}
    assert _options(optimizers["generator"]) == {"lr": 2e-4, "betas": (0.5, 0.999),
                                                 "weight_decay": 0.0}
    assert _options(optimizers["discriminator"])["lr"] == 4e-4
    assert type(_optimizers(load(tmp_path).optim)) is torch.optim.AdamW  # one, without


def test_per_module_clip_grad_and_accumulate_are_that_wrappers(tmp_path):
    """They reach the submodule's optimiser wrapper, not its optimiser (which they crashed)."""
    text = MINIMAL + """\
optim:
  type: Adam
  clip_grad: 5.0
  per_module: {generator: {}, discriminator: {clip_grad: 1.0, accumulate: 2}}
"""
    optim = OmegaConf.to_container(load(tmp_path, text).optim)
    wrappers = wrap_optimizers(_optimizers(optim), optim, "fp32", "cpu")
    generator, discriminator = wrappers["generator"], wrappers["discriminator"]
    assert (generator.clip_grad["max_norm"], generator.accumulate) == (5.0, 1)
    assert (discriminator.clip_grad["max_norm"], discriminator.accumulate) == (1.0, 2)


def test_clip_grad_by_value_reaches_the_wrapper_as_given(tmp_path):
    """``{clip_value: ...}`` (torch's clip_grad_value_ arguments) is kept as it is; a
    per-module override replaces the shared form whole."""
    text = MINIMAL + """\
optim:
  type: SGD
  clip_grad: {clip_value: 0.5}
  per_module: {generator: {}, discriminator: {clip_grad: {clip_value: 0.1, foreach: false}}}
"""
    optim = OmegaConf.to_container(load(tmp_path, text).optim)
    assert optim["clip_grad"] == {"clip_value": 0.5}
    wrappers = wrap_optimizers(_optimizers(optim), optim, "fp32", "cpu")
    assert wrappers["generator"].clip_grad == {"clip_value": 0.5}
    assert wrappers["discriminator"].clip_grad == {"clip_value": 0.1, "foreach": False}
    one = OmegaConf.to_container(load(tmp_path, overrides=["optim.clip_grad.clip_value=2"]).optim)
    assert one["clip_grad"] == {"clip_value": 2}


def test_clip_grad_by_value_is_refused_under_deepspeed_at_config_time(tmp_path):
    """DeepSpeed's engine clips the total norm only (gradient_clipping)."""
    config = Path(__file__).resolve().parents[2] / "configs" / "digits_deepspeed_zero2.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(str(config), ["optim.clip_grad.clip_value=0.5"],
                    values={"work_dir": str(tmp_path / "run")})
    assert str(caught.value).startswith(
        "optim.clip_grad: got {'clip_value': 0.5}, expected null, a number > 0 or "
        "{max_norm: ...} with strategy 'deepspeed'"), caught.value
    assert not (tmp_path / "run").exists()
    norm = load_config(str(config), ["optim.clip_grad=0.5"],  # by norm it takes
                       values={"work_dir": str(tmp_path / "run")})
    assert norm.optim.clip_grad.max_norm == 0.5


def test_per_module_may_change_the_optimiser_type(tmp_path):
    text = MINIMAL + "optim: {type: Adam, per_module: {d: {type: SGD, momentum: 0.9}, g: null}}\n"
    optimizers = _optimizers(load(tmp_path, text).optim)
    assert type(optimizers["d"]) is torch.optim.SGD
    assert _options(optimizers["d"]) == {"lr": 1e-3, "weight_decay": 0.0, "momentum": 0.9}
    assert type(optimizers["g"]) is torch.optim.Adam


def test_per_module_override_that_the_other_type_rejects_names_the_shared_key(tmp_path):
    text = MINIMAL + "optim: {type: Adam, betas: [0.5, 0.9], per_module: {d: {type: SGD}}}\n"
    assert error(tmp_path, text).startswith("unknown key 'optim.betas'")


# ---------------------------------------------------------------- data, logging, checkpoint

def test_a_data_section_splits_into_data_set_and_loader_options(tmp_path):
    cfg = load(tmp_path, MINIMAL + "  val: {type: digits, split: val, metrics: [accuracy]}\n")
    assert dataset_kwargs(cfg.data.val) == {"split": "val"}
    assert set(LOADER_KEYS) <= set(cfg.data.val)  # every loader option gets its default
    assert "batch_size" in LOADER_KEYS and "type" not in LOADER_KEYS


def test_data_val_may_be_a_mapping_of_named_sets(tmp_path):
    text = MINIMAL + ("  val:\n    clean: {type: digits, split: val}\n"
                      "    noisy: {type: digits, split: val, batch_size: 8, metrics: [mean]}\n"
                      "checkpoint: {save_best: val/noisy/loss}\n")
    cfg = load(tmp_path, text)
    assert list(cfg.data.val) == ["clean", "noisy"]
    assert cfg.data.val.clean.batch_size == 32 and cfg.data.val.clean.shuffle is False
    assert list(cfg.data.val.noisy.metrics) == ["mean"]
    assert cfg.checkpoint.best_rule == "less"
    assert error(tmp_path, text.replace("val/noisy/loss", "val/nosy/loss")).startswith(
        "checkpoint.save_best: got 'val/nosy/loss', expected val/<name>/<metric>")
    # a section missing its type stays one section (its keys are a section's)
    assert error(tmp_path, MINIMAL + "  val: {split: val, batch_size: 4}\n") == (
        "data.val.type: missing, expected a non-empty string (a registered name or a dotted "
        "import path)")


def test_a_data_set_kwarg_that_looks_like_a_loader_option_is_a_warning(tmp_path):
    warnings: list[str] = []
    cfg = load(tmp_path, overrides=["data.train.batchsize=8"], on_warning=warnings.append)
    assert cfg.data.train.batchsize == 8
    assert warnings == ["data.train.batchsize is passed to the data set; "
                        "did you mean 'data.train.batch_size'?"]


def test_persistent_workers_with_workers(tmp_path):
    cfg = load(tmp_path, overrides=["data.train.num_workers=2",
                                    "data.train.persistent_workers=true"])
    assert cfg.data.train.persistent_workers is True


def test_missing_tensorboard_is_refused_as_wandb_and_mlflow_are(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, overrides=["logging.backends=[console,tensorboard,console]"])
    assert str(caught.value) == ("logging.backends[1]: got 'tensorboard', but tensorboard is "
                                 "not installed; pip install trainrun[tensorboard]")


@pytest.mark.parametrize("metric, rule", [("val_loss", "less"), ("accuracy", "greater"),
                                          ("Loss/total", "less"),
                                          ("auto", None)])  # decided by the first metric
def test_best_rule_follows_the_metric_name(tmp_path, metric, rule):
    assert load(tmp_path, overrides=[f"checkpoint.save_best={metric}"]).checkpoint.best_rule == rule


def test_explicit_best_rule_wins(tmp_path):
    cfg = load(tmp_path, overrides=["checkpoint.save_best=loss", "checkpoint.best_rule=greater"])
    assert cfg.checkpoint.best_rule == "greater"


def test_checkpoint_options(tmp_path):
    cfg = load(tmp_path, overrides=["checkpoint.interval=0", "checkpoint.max_keep=-1",
                                    "checkpoint.async=true"])
    assert (cfg.checkpoint.interval, cfg.checkpoint.max_keep) == (0, -1)
    assert cfg.checkpoint["async"] is True


def test_preemption_signals_by_name(tmp_path):
    assert load(tmp_path).preemption.signals == ["SIGTERM", "SIGUSR1"]
    cfg = load(tmp_path, overrides=["preemption.signals=[usr2,TERM]"])
    assert cfg.preemption.signals == ["SIGUSR2", "SIGTERM"]
    assert load(tmp_path, overrides=["preemption.signals=[]"]).preemption.signals == []


def test_seed_may_be_null(tmp_path):
    assert load(tmp_path, overrides=["randomness.seed=null"]).randomness.seed is None


def test_a_runner_built_from_dicts_gets_the_schemas_defaults_and_checks(tmp_path):
    from trainrun.checkpoint.manager import MAX_KEEP
    from trainrun.runner.loops import MAX_EPOCHS
    from trainrun.runner.runner import Runner

    parts = dict(model={"type": "tests.runner.toy.ToyModel"},
                 train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 8,
                                   "batch_size": 4},
                 optim={"type": "SGD", "lr": 0.1}, strategy="none")
    with Runner(work_dir=tmp_path / "run", **parts) as runner:  # no section given: defaults
        assert (runner.seed, runner.max_epochs) == (42, MAX_EPOCHS)
        assert runner.checkpoints.max_keep == MAX_KEEP
        assert runner.stop_signals == ["SIGTERM", "SIGUSR1"]
    # a section given as a dict goes through the same table as the config's
    with pytest.raises(ConfigError, match=r"^unknown key 'checkpoint.max_kep'; "
                                          r"did you mean 'checkpoint.max_keep'\?$"):
        Runner(work_dir=tmp_path / "refused", checkpoint={"max_kep": 1}, **parts)
    with pytest.raises(ConfigError, match=r"^schedule: got both max_epochs \(2\) and max_iters"):
        Runner(work_dir=tmp_path / "refused", schedule={"max_epochs": 2, "max_iters": 5},
               **parts)
    assert not (tmp_path / "refused").exists()
