"""Bad input, everywhere: every config and command line below is refused with exit code 2,
one ``error:`` line naming the key or argument, no traceback, and the run directory left as
it was. The command line runs in this process (``train_main``), as tools/train.py runs it;
tests/tools/test_train_cli.py checks the same contract through a real process."""

from __future__ import annotations

import json
import random
import struct
import time
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from tests.cli import file_bytes, run, torchrun
from tests.runner.toy import Payload, rehash
from trainrun import exits
from trainrun.cli import test as test_tool
from trainrun.cli.train import main as train_main
from trainrun.examples.digits import DigitsMLP
from trainrun.runner.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "digits_ddp.yaml"


def _make_inputs(root: Path) -> dict[str, Path]:
    """The files the cases point at, each made once."""
    root.mkdir()
    marker = root / "pwned"
    files = {"marker": marker}
    files["broken_yaml"] = root / "broken.yaml"
    files["broken_yaml"].write_text("model: {type: DigitsMLP\n")
    files["python_tag"] = root / "tag.yaml"
    files["python_tag"].write_text(CONFIG.read_text() + (
        f"name: !!python/object/apply:os.system ['touch {marker}']\n"))
    files["a_list"] = root / "list.yaml"
    files["a_list"].write_text("- model\n- data\n")
    files["garbage"] = root / "garbage.pth"
    files["garbage"].write_bytes(random.Random(0).randbytes(4096))
    files["crafted"] = root / "crafted.pth"
    torch.save({"model": {}, "meta": Payload(str(marker))}, files["crafted"])
    files["damaged"] = root / "damaged.pth"  # hashed, then one byte of its tensor flipped,
    torch.save({"model": {"w": torch.full((4096,), 0.5)}}, files["damaged"])  # which
    rehash(files["damaged"])  # torch.load itself does not notice
    data = bytearray(files["damaged"].read_bytes())
    data[data.find(struct.pack("<f", 0.5) * 64) + 100] ^= 0xFF
    files["damaged"].write_bytes(bytes(data))
    files["other_model"] = root / "hidden_32.pth"  # the shipped config's MLP, 32 units wide
    torch.save({"model": DigitsMLP(hidden=32).state_dict()}, files["other_model"])
    files["truncated"] = root / "truncated.pth"
    files["truncated"].write_bytes(files["other_model"].read_bytes()[:3000])
    files["plain_dir"] = root / "not_a_checkpoint"
    files["plain_dir"].mkdir()
    (files["plain_dir"] / "notes.txt").write_text("hello")
    files["a_file"] = root / "a_file"
    files["a_file"].write_text("not a directory")
    dangling = root / "dangling" / "checkpoints"
    dangling.mkdir(parents=True)
    (dangling / "last").write_text("iter_9.pth\n")
    files["dangling"] = root / "dangling"
    return files


VAL = "{{type: digits, split: val}}"  # a validation set's section (braces doubled: see below)

# (the command line after tools/train.py, with {placeholders} for the files above; the words
# the one error line must contain). The config is the shipped digits_ddp.yaml unless the case
# names another; --work-dir {work_dir} and --launcher none are added unless the case sets them.
CASES = [
    # types and ranges
    (["--cfg-options", "data.train.batch_size=-4"], ["data.train.batch_size", "-4"]),
    (["--cfg-options", "data.train.batch_size=many"], ["data.train.batch_size", "'many'"]),
    (["--cfg-options", "optim.lr=-0.1"], ["optim.lr", "-0.1"]),
    (["--cfg-options", "hooks.0.momentum=0.1"], ["hooks", "expected a list of hooks"]),
    (["--cfg-options", "optim.lr=fast"], ["optim.lr", "'fast'"]),
    (["--cfg-options", "optim.accumulate=0"], ["optim.accumulate", "0"]),
    (["--cfg-options", "schedule.max_epochs=0"], ["schedule.max_epochs", "0"]),
    (["--cfg-options", "schedule.val_interval=-1"], ["schedule.val_interval"]),
    (["--cfg-options", "logging.interval=0"], ["logging.interval", "0"]),
    (["--cfg-options", "checkpoint.max_keep=0"], ["checkpoint.max_keep", "0"]),
    (["--cfg-options", "checkpoint.async=maybe"], ["checkpoint.async", "'maybe'"]),
    (["--cfg-options", "dist_timeout=0"], ["dist_timeout", "0"]),
    (["--cfg-options", "randomness.seed=-3"], ["randomness.seed", "-3"]),
    (["--cfg-options", "model.dropout=2"], ["dropout"]),
    (["--cfg-options", "preemption.signals=[SIGKILL]"], ["preemption.signals[0]", "SIGKILL",
                                                         "cannot be caught"]),
    (["--cfg-options", "preemption.signals=[SIGNOPE]"], ["preemption.signals[0]", "SIGNOPE"]),
    # unknown keys and values
    (["--cfg-options", "optim.lrr=0.1"], ["optim.lrr", "'optim.lr'"]),
    (["--cfg-options", "colour=blue"], ["colour"]),
    (["--cfg-options", "precision=fp64"], ["precision", "fp64", "bf16"]),
    (["--cfg-options", "strategy.type=dpp"], ["strategy.type", "'ddp'"]),
    (["--cfg-options", "optim.type=Adamm"], ["optim.type", "Adamm"]),
    (["--cfg-options", "scheduler.type=cosin"], ["scheduler.type", "cosin"]),
    (["--cfg-options", "model.type=NoSuchModel"], ["model.type", "NoSuchModel"]),
    (["--cfg-options", "data.train.type=imagenet"], ["data.train.type", "imagenet"]),
    (["--cfg-options", "logging.backends=[console,wandbb]"],
     ["logging.backends[1]", "'wandbb'", "did you mean 'wandb'"]),
    (["--cfg-options", "logging.backends=[no.such.Tracker]"],
     ["logging.backends[0]", "'no.such.Tracker'", "No module named 'no'"]),
    (["--dry-run", "--cfg-options", "logging.backends=[jsonl,tests.tools.trackers.NoFinish]"],
     ["logging.backends[1]", "NoFinish", "it has no finish"]),
    (["--cfg-options", "logging.backends=[tests.tools.trackers.NeedsArguments]"],
     ["logging.backends[0]", "NeedsArguments", "made without arguments"]),
    (["--cfg-options", "logging.backends=[tests.tools.trackers.NOT_A_CLASS]"],
     ["logging.backends[0]", "NOT_A_CLASS", "it is a dict"]),
    (["--cfg-options", "logging.backends=[tests.tools.trackers.Nope]"],
     ["logging.backends[0]", "tests.tools.trackers.Nope", "has no attribute 'Nope'"]),
    (["--cfg-options", "backend=tpu"], ["backend", "tpu"]),
    (["--cfg-options", "strategy.type=deepspeed", "strategy.zero_stage=5"],
     ["strategy.zero_stage", "5"]),
    (["--cfg-options", "optim.lr"], ["optim.lr"]),
    # conflicting settings
    (["--cfg-options", "schedule.max_iters=100", "schedule.max_epochs=3"],
     ["max_epochs", "max_iters"]),  # both on the command line (one replaces the file's other)
    # what only importing or building tells, refused by the dry run too
    (["--cfg-options", "model.type=no.such.Model"], ["model.type", "no.such.Model"]),
    (["--dry-run", "--cfg-options", "model.type=no.such.Model"], ["model.type", "no.such"]),
    (["--cfg-options", "data.val.metrics=[acuracy]"],
     ["data.val.metrics", "did you mean 'accuracy'"]),
    (["--dry-run", "--cfg-options", "data.val.metrics=[acuracy]"],
     ["data.val.metrics", "did you mean 'accuracy'"]),
    (["--cfg-options", "data.train.batch_size=2000", "data.train.drop_last=true"],
     ["data.train.batch_size", "2000", "1258 samples"]),
    (["--dry-run", "--cfg-options", "data.train.batch_size=2000", "data.train.drop_last=true"],
     ["data.train.batch_size", "2000", "1258 samples"]),
    (["--cfg-options", "strategy.type=deepspeed", "checkpoint.async=true"],
     ["checkpoint.async", "deepspeed"]),
    (["--cfg-options", "scheduler.type=cosine", "scheduler.warmup_iters=5000"],
     ["scheduler.warmup_iters", "5000"]),
    # the hooks: list (a bad value of each option of the shipped hooks, a user's hook)
    (["--cfg-options", "hooks=5"], ["hooks", "5", "a list of hooks"]),
    (["--cfg-options", "hooks=[EarlyStopping]"], ["hooks[0]", "a mapping with a 'type'"]),
    (["--cfg-options", "hooks=[{{type: EarlyStoping, metric: accuracy}}]"],
     ["hooks[0].type", "did you mean 'EarlyStopping'"]),
    (["--dry-run", "--cfg-options", "hooks=[{{type: collections.OrderedDict}}]"],
     ["hooks[0].type", "collections.OrderedDict", "a subclass of trainrun.runner.hooks.Hook"]),
    (["--cfg-options", "hooks=[{{type: no.such.Hook}}]"], ["hooks[0].type", "no.such.Hook"]),
    (["--cfg-options", "hooks=[{{type: EarlyStopping}}]"], ["hooks[0].metric: missing"]),
    (["--cfg-options", "hooks=[{{type: EarlyStopping, metric: acuracy}}]"],  # when built
     ["hooks[0].metric", "'acuracy'", "did you mean 'accuracy'"]),
    (["--cfg-options", "hooks=[{{type: EarlyStopping, metric: accuracy}}]", "data.val=null"],
     ["hooks[0].metric", "no validation"]),
    (["--cfg-options", "hooks=[{{type: EarlyStopping, metric: accuracy, rule: bigger}}]"],
     ["hooks[0].rule", "bigger", "greater"]),
    (["--cfg-options", "hooks=[{{type: EarlyStopping, metric: accuracy, patience: 0}}]"],
     ["hooks[0].patience", "0", "an int >= 1"]),
    (["--dry-run", "--cfg-options", "hooks=[{{type: EarlyStopping, metric: accuracy, "
      "min_delta: -0.1}}]"], ["hooks[0].min_delta", "-0.1"]),
    (["--cfg-options", "hooks=[{{type: EarlyStopping, metric: accuracy, patiance: 3}}]"],
     ["hooks[0].patiance", "did you mean 'hooks[0].patience'"]),
    (["--cfg-options", "hooks=[{{type: EMA, momentum: 0}}]"],
     ["hooks[0].momentum", "got 0", "a number in (0, 1]"]),
    (["--dry-run", "--cfg-options", "hooks=[{{type: EMA, momentum: 1.5}}]"],
     ["hooks[0].momentum", "1.5"]),
    (["--cfg-options", "hooks=[{{type: EMA, interval: 0}}]"], ["hooks[0].interval", "0"]),
    (["--cfg-options", "hooks=[{{type: EMA, warmup: -5}}]"], ["hooks[0].warmup", "-5"]),
    (["--cfg-options", "hooks=[{{type: EMA, evaluate: sometimes}}]"],
     ["hooks[0].evaluate", "'sometimes'", "true or false"]),
    (["--cfg-options", "hooks=[{{type: EMA, decay: 0.999}}]"],
     ["hooks[0].decay", "expected one of"]),
    (["--cfg-options", "hooks=[{{type: Profiler, priority: soon}}]"],
     ["hooks[0].priority", "soon", "before_checkpoint"]),
    (["--cfg-options", "hooks=[{{type: Profiler, wait: -1}}]"], ["hooks[0].wait", "-1"]),
    (["--cfg-options", "hooks=[{{type: Profiler, warmup: x}}]"], ["hooks[0].warmup", "'x'"]),
    (["--cfg-options", "hooks=[{{type: Profiler, active: 0}}]"], ["hooks[0].active", "0"]),
    (["--cfg-options", "hooks=[{{type: Profiler, repeat: -2}}]"], ["hooks[0].repeat", "-2"]),
    (["--cfg-options", "hooks=[{{type: Profiler, ranks: []}}]"], ["hooks[0].ranks", "[]"]),
    (["--cfg-options", "hooks=[{{type: Profiler, ranks: [1]}}]"],  # one process: no rank 1
     ["hooks[0].ranks", "world size (1)"]),
    (["--cfg-options", "hooks=[{{type: Profiler, record_shapes: maybe}}]"],
     ["hooks[0].record_shapes", "'maybe'"]),
    (["--cfg-options", "hooks=[{{type: Profiler, profile_memory: 2}}]"],
     ["hooks[0].profile_memory", "2"]),
    (["--cfg-options", "hooks=[{{type: Profiler, with_stack: often}}]"],
     ["hooks[0].with_stack", "'often'"]),
    (["--cfg-options", "hooks=[{{type: Profiler}}, {{type: tests.tools.models.CountingHook, "
      "wieght: 2}}]"], ["hooks[1].wieght", "did you mean 'hooks[1].weight'"]),
    (["--cfg-options", "hooks=[{{type: tests.tools.models.CountingHook, weight: 0}}]"],
     ["hooks[0].weight: got 0, expected an int >= 1"]),  # the constructor's ValueError
    # data options (issue 13): collate_fn
    (["--cfg-options", "data.train.collate_fn=pad_sequence"],
     ["data.train.collate_fn", "did you mean 'pad_sequences'"]),
    (["--dry-run", "--cfg-options", "data.train.collate_fn=pad_sequence"],
     ["data.train.collate_fn", "did you mean 'pad_sequences'"]),
    (["--cfg-options", "data.train.collate_fn=5"], ["data.train.collate_fn", "got 5"]),
    (["--cfg-options", "data.val.collate_fn=os.sep"], ["data.val.collate_fn", "os.sep", "str"]),
    (["--cfg-options", "data.train.collate_fn.type=pad_sequences", "data.train.collate_fn.pad=0"],
     ["data.train.collate_fn", "pad_sequences", "'pad'"]),
    (["--cfg-options", "data.train.collate_fn=no_such_pkg.collate"],
     ["data.train.collate_fn", "no_such_pkg"]),
    # data options (issue 13): several validation sets (data.val=null first: a mapping
    # merged onto the file's one section would extend it; braces doubled for str.format)
    (["--cfg-options", "data.val=null", "data.val={{clean: " + VAL + ", noisy: {{type: "
      "digits, split: val, batch_size: 0}}}}"], ["data.val.noisy.batch_size", "0"]),
    (["--cfg-options", "data.val=null", "data.val={{clean: " + VAL + ", noisy: " + VAL + "}}",
      "checkpoint.save_best=val/clen/accuracy"],
     ["checkpoint.save_best", "did you mean 'val/clean/accuracy'"]),
    (["--dry-run", "--cfg-options", "data.val=null", "data.val={{clean: " + VAL + ", noisy: "
      + VAL + "}}", "checkpoint.save_best=accuracy"],
     ["checkpoint.save_best", "val/<name>/<metric>"]),
    (["--cfg-options", "data.val=null", "data.val={{clean: " + VAL + ", noisy: {{type: "
      "digits, split: val, metrics: [acuracy]}}}}"],
     ["data.val.noisy.metrics", "did you mean 'accuracy'"]),
    (["--cfg-options", "data.val=null", "data.val={{'a/b': " + VAL + "}}"],
     ["data.val.a/b", "'/'"]),
    # data options (issue 13): iterable data sets where a stream cannot serve
    (["--cfg-options", "data.train.type=tests.tools.models.StatefulDigitsStream"],
     ["schedule.max_epochs", "without a length", "schedule.max_iters"]),
    (["--dry-run", "--cfg-options", "data.train.type=tests.tools.models.DigitsStream"],
     ["schedule.max_epochs", "without a length"]),
    (["--cfg-options", "data.val.type=tests.tools.models.StatefulDigitsStream"],
     ["data.val.type", "IterableDataset", "data.train only"]),
    (["--dry-run", "--cfg-options", "data.test.type=tests.tools.models.DigitsStream"],
     ["data.test.type", "IterableDataset"]),
    # keys the model or data set class does not take, or an argument it needs (issue 22):
    # refused by the dry run too, and by --nproc before any worker starts
    (["--cfg-options", "data.train.batch_sise=8"],
     ["error: unknown key 'data.train.batch_sise'; did you mean 'data.train.batch_size'?"]),
    (["--dry-run", "--cfg-options", "data.train.batch_sise=8"],
     ["error: unknown key 'data.train.batch_sise'; did you mean 'data.train.batch_size'?"]),
    (["--dry-run", "--cfg-options", "model.hiden=64"],
     ["error: unknown key 'model.hiden'; did you mean 'model.hidden'?"]),
    (["--cfg-options", "model.hiden=64"],
     ["error: unknown key 'model.hiden'; did you mean 'model.hidden'?"]),
    (["--dry-run", "--cfg-options", "data.val.spilt=test"],
     ["error: unknown key 'data.val.spilt'; did you mean 'data.val.split'?"]),
    (["--dry-run", "--cfg-options", "data.train.type=tests.tools.newcomer.FolderDigits"],
     ["error: data.train.root: missing; tests.tools.newcomer.FolderDigits needs it"]),
    (["--nproc", "2", "--cfg-options", "data.train.batch_sise=8"],
     ["error: unknown key 'data.train.batch_sise'; did you mean 'data.train.batch_size'?"]),
    (["--nproc", "2", "--cfg-options", "data.train.batch_size=2000", "data.train.drop_last=true"],
     ["data.train.batch_size", "2000", "629 per process on 2 processes"]),  # the dry run's
    (["--nproc", "2", "--launcher", "slurm"],
     ["error: --nproc: starts its workers with torchrun (--launcher pytorch), not with "
      "--launcher slurm"]),
    (["--nproc", "2", "--dry-run", "--world-size", "4"],
     ["error: --world-size: got 4 with --nproc 2"]),
    (["--nproc", "0"], ["--nproc", "'0'"]),
    (["--cfg-options", "model.type=my_modl.Net"],
     ["error: model.type: model type 'my_modl.Net': no module named 'my_modl' (type: paths are "
      "imported from the working directory, ", "and PYTHONPATH; run trainrun from the "
      "directory that holds my_modl.py, or add its directory to PYTHONPATH)"]),
    # missing or corrupt checkpoints and paths
    (["--resume", "{root}/missing.pth"], ["resume", "missing.pth"]),
    (["--resume", "{garbage}"], ["resume", "garbage.pth", "not a readable checkpoint"]),
    (["--resume", "{crafted}"], ["resume", "crafted.pth", "refused", "system"]),
    (["--resume", "{plain_dir}"], ["resume", "not_a_checkpoint", "last"]),
    (["--resume", "{dangling}"], ["resume", "iter_9.pth"]),
    (["--cfg-options", "load_from={garbage}"], ["load_from", "garbage.pth"]),
    (["--cfg-options", "load_from={other_model}"],
     ["load_from: ", "hidden_32.pth was written by another model: net.0.weight has shape "
      "[32, 64] there, the model's [256, 64]"]),
    (["--resume", "{other_model}", "--force"],  # the config check let through
     ["resume: ", "hidden_32.pth was written by another model"]),
    (["--resume", "{truncated}"], ["resume: ", "truncated.pth is truncated"]),
    (["--resume", "{damaged}", "--cfg-options", "model.hidden=64"],  # the run's own config
     ["resume: ", "damaged.pth is damaged: damaged.pth: sha256 mismatch (against "
      "damaged.pth.sha256)"]),
    (["--cfg-options", "load_from={damaged}"], ["load_from: ", "damaged.pth is damaged"]),
    (["--cfg-options", "load_from={crafted}"], ["load_from", "refused", "system"]),
    (["--work-dir", "{a_file}"], ["work_dir", "a_file", "file"]),
    # config files
    (["CONFIG={root}/nope.yaml"], ["nope.yaml"]),
    (["CONFIG={broken_yaml}"], ["broken.yaml"]),
    (["CONFIG={python_tag}"], ["tag.yaml", "python/object/apply"]),
    (["CONFIG={a_list}"], ["list.yaml", "mapping"]),
    # the command line itself, and launchers started the wrong way
    (["--launcher", "torch"], ["--launcher", "torch"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--launcher", "pytorch"], ["launcher", "RANK", "torchrun"]),
    (["--launcher", "slurm"], ["launcher", "slurm", "srun"]),
    (["--launcher", "mpi"], ["launcher", "mpi"]),
    # resuming a run with another config (the run directory's config.yaml has hidden: 64)
    (["--resume"], ["resume", "config.yaml", "model.hidden: 64 -> 256", "--force"]),
    (["--resume", "--cfg-options", "schedule.max_epochs=30", "optim.lr=0.01"],
     ["2 key(s)", "model.hidden: 64 -> 256", "optim.lr: 0.001 -> 0.01"]),
]


def test_bad_input_is_refused_with_exit_2_one_line_and_nothing_written(tmp_path, capfd,
                                                                        clean_env):
    assert len(CASES) >= 40
    inputs = _make_inputs(tmp_path / "inputs")
    work_dir = tmp_path / "run"  # a run directory with a finished run in it, left as it is
    (work_dir / "checkpoints").mkdir(parents=True)
    (work_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    saved = load_config(CONFIG, ["model.hidden=64"], values={"work_dir": str(work_dir)})
    (work_dir / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    before = file_bytes(tmp_path)
    failures = []
    for args, words in CASES:
        values = {"root": tmp_path / "inputs", "work_dir": work_dir,
                  **{k: str(v) for k, v in inputs.items()}}
        args = [a.format(**values) for a in args]
        config = str(CONFIG)
        if args[0].startswith("CONFIG="):
            config = args.pop(0).removeprefix("CONFIG=")
        if "--work-dir" not in args:
            args += ["--work-dir", str(work_dir)]
        if "--launcher" not in args:
            args += ["--launcher", "none"]
        code = train_main([config, *args])
        out, err = capfd.readouterr()
        errors = [line for line in err.splitlines() if line.startswith("error:")
                  or "error: argument" in line or "unrecognized arguments" in line]
        problems = []
        if code != 2:
            problems.append(f"exit {code}")
        if "Traceback" in err:
            problems.append("a traceback")
        if len(errors) != 1:
            problems.append(f"{len(errors)} error lines")
        missing = [w for w in words if not any(w in line for line in errors)]
        if missing:
            problems.append(f"no {missing}")
        if problems:
            failures.append(f"{args}: {', '.join(problems)}\n    stderr: {err.strip()[-600:]}")
    assert not failures, f"{len(failures)} of {len(CASES)} cases:\n" + "\n".join(failures)
    assert file_bytes(tmp_path) == before  # nothing written, nothing changed
    assert not inputs["marker"].exists()  # nothing ran


def test_the_test_tool_refuses_what_is_no_checkpoint(tmp_path, capfd, clean_env):
    inputs = _make_inputs(tmp_path / "inputs")
    for name, words in [("garbage", ["not a readable checkpoint"]),
                        ("crafted", ["refused", "system"]), ("plain_dir", ["last"])]:
        code = test_tool.main([str(CONFIG), str(inputs[name]), "--launcher", "none",
                          "--work-dir", str(tmp_path / "run")])
        err = capfd.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: CHECKPOINT: ")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert all(word in errors[0] for word in words), errors[0]
    assert not (tmp_path / "run").exists() and not inputs["marker"].exists()


SINGLE = REPO / "configs" / "digits_single.yaml"
SHORT = ["schedule.max_epochs=null", "schedule.max_iters=4", "checkpoint.interval=2",
         "logging.interval=2"]


def test_resume_may_change_the_length_and_with_force_anything(tmp_path, capfd, clean_env):
    work_dir = str(tmp_path / "run")
    assert train_main([str(SINGLE), "--work-dir", work_dir, "--cfg-options", *SHORT]) == 0
    first = (tmp_path / "run" / "config.yaml").read_text()
    # a longer schedule is the same run, going on: no --force needed
    longer = [*SHORT, "schedule.max_iters=6"]
    assert train_main([str(SINGLE), "--work-dir", work_dir, "--resume",
                       "--cfg-options", *longer]) == 0
    assert "resumed from" in capfd.readouterr().err
    kept = sorted(p.name for p in (tmp_path / "run").glob("config*.yaml"))
    assert len(kept) == 2 and (tmp_path / "run" / kept[0]).read_text() == first
    assert "max_iters: 6" in (tmp_path / "run" / "config.yaml").read_text()
    # another learning rate is another run: refused, then forced with a warning
    changed = [*longer, "schedule.max_iters=8", "optim.lr=0.002"]
    assert train_main([str(SINGLE), "--work-dir", work_dir, "--resume",
                       "--cfg-options", *changed]) == 2
    assert "optim.lr: 0.001 -> 0.002; pass --force" in capfd.readouterr().err
    assert train_main([str(SINGLE), "--work-dir", work_dir, "--resume", "--force",
                       "--cfg-options", *changed]) == 0
    err = capfd.readouterr().err
    assert "warning: resume: --force:" in err and "optim.lr: 0.001 -> 0.002" in err
    assert "lr: 0.002" in (tmp_path / "run" / "config.yaml").read_text()
    assert len(list((tmp_path / "run").glob("config*.yaml"))) == 3
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "mode" not in line]
    assert steps == [2, 4, 6, 8]
    # another optimiser type cannot take the checkpoint's state: refused, --force or not,
    # before anything is written (torch would load it, and the first step fail)
    record = file_bytes(tmp_path / "run")
    retyped = [*changed, "schedule.max_iters=10", "optim.type=SGD"]
    assert train_main([str(SINGLE), "--work-dir", work_dir, "--resume", "--force",
                       "--cfg-options", *retyped]) == 2
    assert ("error: resume: --force cannot change the optimiser's type (optim.type: 'AdamW' "
            "-> 'SGD')") in capfd.readouterr().err
    assert file_bytes(tmp_path / "run") == record


def test_resume_of_a_run_from_before_a_key_was_added(tmp_path, capfd, clean_env):
    """A run directory written before trainrun knew ``hooks``, ``compile``,
    ``logging.step_metrics`` and ``logging.window`` resumes without --force while the first two
    stay at their empty defaults (the logging keys may change: they change what is logged
    only); setting one of the first two is a change, as ever."""
    work_dir = tmp_path / "run"
    assert train_main([str(SINGLE), "--work-dir", str(work_dir), "--cfg-options", *SHORT]) == 0
    saved = yaml.safe_load((work_dir / "config.yaml").read_text())
    assert saved["hooks"] == [] and saved["compile"] is False
    assert saved["logging"]["step_metrics"] is True and saved["logging"]["window"] == 1
    del saved["hooks"], saved["compile"], saved["logging"]["step_metrics"]  # an older trainrun's
    del saved["logging"]["window"]
    (work_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    longer = [*SHORT, "schedule.max_iters=6"]
    assert train_main([str(SINGLE), "--work-dir", str(work_dir), "--resume",
                       "--cfg-options", *longer, "logging.step_metrics=false",
                       "logging.window=3"]) == 0
    assert "resumed from" in capfd.readouterr().err
    assert train_main([str(SINGLE), "--work-dir", str(work_dir), "--resume", "--cfg-options",
                       *longer, "schedule.max_iters=8", "compile=true"]) == 2
    err = capfd.readouterr().err
    assert "compile: false -> unset; compile.backend: unset -> 'inductor'" in err, err


@pytest.mark.parametrize("rank", [0, 1])
def test_a_bad_config_under_torchrun_is_said_by_rank_0_alone(tmp_path, capfd, clean_env,
                                                            monkeypatch, rank):
    """Every rank finds the same bad config: rank 0 says it, the others exit 2 in silence,
    after waiting for rank 0 to say it (torchrun stops the other ranks once one has ended)."""
    for name, value in {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", "LOCAL_RANK": str(rank)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(exits, "REFUSAL_GRACE", 0.5)
    started = time.monotonic()
    code = train_main([str(CONFIG), "--launcher", "pytorch", "--work-dir",
                       str(tmp_path / "run"), "--cfg-options", "optim.lr=abc"])
    waited = time.monotonic() - started
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and not (tmp_path / "run").exists()
    if rank == 0:
        assert errors == ["error: optim.lr: got 'abc', expected a number > 0"] and waited < 0.5
    else:
        assert errors == [] and waited >= 0.5


def test_a_refusal_rank_0_reaches_last_is_still_said_once_under_torchrun(tmp_path):
    """What only the built model shows (here: no tensor-parallel plan) is refused by every
    rank; rank 0, late to it (its model takes a second longer to build), still says it, and
    it alone."""
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path / "run"),
                        "--cfg-options", "model.type=tests.tools.models.RankZeroLateDigitsMLP",
                        "strategy.type=fsdp", "strategy.tp=2"))
    assert "exitcode  : 2" in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: strategy.tp: 2 splits the model"), \
        done.stderr[-3000:]
