"""``compile`` through the command line, as a user runs it: a bad value of each of its keys
(exit 2, the key named, nothing written), the dry run's plan, the shipped digits config
compiled on 2 processes against the same run uncompiled (losses within 1e-5 at every step,
the same checkpoint keys, checkpoints loading both ways), tiny-LM under fsdp compiled per
transformer block, and a fullgraph failure naming the module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli import REPO, TRAIN, env, run, torchrun
from tests.records import losses
from tests.runs import COMPILE_STEPS
from trainrun.cli.train import main as train_main

DIGITS = REPO / "configs" / "digits_ddp.yaml"
TINYLM = REPO / "configs" / "tinylm_fsdp.yaml"
TEST = REPO / "tools" / "test.py"

# (the --cfg-options; the words the one error line must contain)
BAD = [
    (["compile=3"], ["compile: got 3", "false, true or a mapping"]),
    (["compile.backend=tensorrt"], ["compile.backend", "'tensorrt'", "inductor, aot_eager"]),
    (["compile.mode=turbo"], ["compile.mode", "'turbo'", "max-autotune"]),
    (["compile.fullgraph=yes please"], ["compile.fullgraph", "true or false"]),
    (["compile.dynamic=sometimes"], ["compile.dynamic", "'sometimes'", "null or true"]),
    (["compile.dinamic=true"], ["compile.dinamic", "did you mean 'compile.dynamic'"]),
    (["compile={backend: aot_eager, mode: reduce-overhead}"], ["compile.mode", "inductor's"]),
    (["compile=true", "strategy.type=deepspeed", "strategy.zero_stage=3"],
     ["compile", "ZeRO stage 3"]),
]


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
def test_a_bad_value_of_each_key_exits_2_naming_it_and_writes_nothing(tmp_path, capfd,
                                                                       clean_env, dry_run):
    failures = []
    for options, words in BAD:
        code = train_main([str(DIGITS), "--launcher", "none", "--work-dir",
                           str(tmp_path / "run"), *(["--dry-run"] if dry_run else []),
                           "--cfg-options", *options])
        err = capfd.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        if code != 2 or len(errors) != 1 or "Traceback" in err or \
                not all(word in errors[0] for word in words):
            failures.append(f"{options}: exit {code}: {err.strip()[-400:]}")
    assert not failures, "\n".join(failures)
    assert list(tmp_path.iterdir()) == []


def test_a_real_process_exits_2_too(tmp_path):
    done = run([sys.executable, str(TRAIN), str(DIGITS), "--launcher", "none", "--work-dir",
                str(tmp_path / "run"), "--cfg-options", "compile.mode=fast"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: compile.mode: got 'fast'")
    assert not (tmp_path / "run").exists()


def _compile_rows(out: str) -> list[str]:
    return [line.split(None, 1)[1] for line in out.splitlines()
            if line.strip().startswith("compile ")]


def test_the_dry_run_shows_what_is_compiled(capsys, clean_env):
    assert train_main([str(TINYLM), "--dry-run", "--launcher", "none", "--cfg-options",
                       "compile={mode: max-autotune}"]) == 0
    assert _compile_rows(capsys.readouterr().out) == [
        "each shard unit strategy.wrap names (the whole model where it names none), before "
        "fully_shard; backend=inductor, mode=max-autotune, fullgraph=false, dynamic=null (at "
        "the first step)"]
    assert train_main([str(DIGITS), "--dry-run", "--launcher", "none"]) == 0
    assert _compile_rows(capsys.readouterr().out) == ["no"]



def _close(straight: dict[int, float], compiled: dict[int, float], steps: int) -> None:
    assert sorted(straight) == sorted(compiled) == list(range(1, steps + 1))
    far = {step: (straight[step], compiled[step]) for step in straight
           if abs(straight[step] - compiled[step]) > 1e-5}
    assert not far, far


def _model_keys(checkpoint: Path) -> list[str]:
    return list(torch.load(checkpoint, weights_only=True, map_location="cpu")["model"])


@pytest.mark.slow
def test_compiled_digits_logs_the_losses_of_the_uncompiled_run(compile_runs):
    log = (compile_runs / "compiled" / "train.log").read_text()
    assert "compile: model (DigitsMLP) is compiled at its first call (backend=inductor, " \
           "mode=default, fullgraph=False, dynamic=None)" in log
    assert "compile:" not in (compile_runs / "plain" / "train.log").read_text()
    _close(losses(compile_runs / "plain"), losses(compile_runs / "compiled"), COMPILE_STEPS)


@pytest.mark.slow
def test_compiled_checkpoints_keep_the_keys_and_load_both_ways(compile_runs):
    plain, compiled = (compile_runs / name / "checkpoints" / f"iter_{COMPILE_STEPS}.pth"
                       for name in ("plain", "compiled"))
    assert _model_keys(compiled) == _model_keys(plain)
    for checkpoint, compile_ in [(compiled, "false"), (plain, "{backend: eager}")]:
        done = run([sys.executable, str(TEST), str(DIGITS), str(checkpoint), "--launcher",
                    "none", "--cfg-options", f"compile={compile_}"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert "accuracy" in done.stdout + done.stderr


def test_a_fullgraph_failure_exits_1_naming_the_module(tmp_path):
    work_dir = tmp_path / "run"
    done = run([sys.executable, str(TRAIN), str(DIGITS), "--launcher", "none", "--work-dir",
                str(work_dir), "--cfg-options", "model.type=tests.tools.models.ItemDigitsMLP",
                "compile={backend: eager, fullgraph: true}", "schedule.max_iters=2"])
    assert done.returncode == 1, done.stderr[-3000:]
    line = "compile: fullgraph compile of ItemDigitsMLP (model) failed: "
    assert line in done.stderr.strip().splitlines()[-1], done.stderr[-3000:]
    log = (work_dir / "train.log").read_text()
    assert "training failed at step 1" in log and "Traceback" in log and line in log


@pytest.mark.slow
def test_tinylm_under_fsdp_compiled_per_block_logs_the_uncompiled_losses(tmp_path):
    """Each transformer block a compiled shard unit, with activation checkpointing."""
    steps = 4
    for name, compile_ in [("plain", "false"), ("compiled", "true")]:
        done = subprocess.run(
            torchrun(str(TINYLM), "--launcher", "pytorch", "--work-dir", str(tmp_path / name),
                     "--cfg-options", f"schedule.max_iters={steps}", "logging.interval=1",
                     "data.val=null", f"compile={compile_}"),
            capture_output=True, text=True, timeout=600, env=env())
        assert done.returncode == 0, done.stderr[-4000:]
    log = (tmp_path / "compiled" / "train.log").read_text()
    assert [line.split(" INFO ")[1].split(" is ")[0] for line in log.splitlines()
            if " INFO compile: " in line] == ["compile: model.blocks.0 (Block)",
                                              "compile: model.blocks.1 (Block)"]
    _close(losses(tmp_path / "plain"), losses(tmp_path / "compiled"), steps)
