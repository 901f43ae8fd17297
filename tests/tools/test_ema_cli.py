"""The EMA hook through the command line: SIGKILL and --resume on 2 processes under fsdp and
ZeRO-3 (tools/verify_resume.py, which also proves those strategies resume exactly when chosen
with --cfg-options, as a sweep would), then ``tools/export.py --ema`` and ``tools/test.py`` on
the checkpoints it left. The average itself, and ddp, are tests/runner/test_ema.py's; bad
values of its options are tests/tools/test_bad_input.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.cli import CONFIG
from trainrun.cli import test as test_tool
from trainrun.cli import verify_resume as vr
from trainrun.cli.export import main as export_main

EMA = "hooks=[{type: EMA, momentum: 0.1, warmup: 4}]"


def _root(stdout: str) -> Path:
    """The run directory the tool named in its first line."""
    return Path(stdout.splitlines()[0].split("; runs in ")[1])


def _export(checkpoint: Path, out: Path, *flags: str) -> dict[str, torch.Tensor]:
    assert export_main([str(checkpoint), str(out), "--format", "torch", *flags]) == 0
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("options", [["strategy.type=fsdp"],
                                     ["strategy.type=deepspeed", "strategy.zero_stage=3"]],
                         ids=["fsdp", "zero3"])
@pytest.mark.usefixtures("child_env")
def test_sigkill_and_resume_keep_the_average_exactly(capsys, tmp_path, options):
    """SIGKILL after the step-4 checkpoint, then --resume to step 8: the losses match bit for
    bit, and so does the average (the exported EMA weights of both runs' last checkpoints).
    fsdp keeps its runs for export and test; ZeRO-3's temporary runs are removed."""
    keep = options == ["strategy.type=fsdp"]
    code = vr.main([str(CONFIG), "--nproc", "2", "--steps", "8", *(["--keep"] if keep else []),
                    "--cfg-options", *options, EMA])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = out.splitlines()
    assert "8 steps on 2 processes (torchrun)" in lines[0]
    assert any(line.startswith("interrupted: killed with SIGKILL after step ") for line in lines)
    assert any(line.startswith("validation at step 8: accuracy 0.") for line in lines)
    assert "exact resume: the losses of steps 1-8 match bit for bit" in lines, out
    root = _root(out)
    if not keep:
        assert not root.exists()  # the temporary runs are removed
        return
    try:
        _exports_and_tests_the_average(root, tmp_path, capsys)
    finally:
        shutil.rmtree(root)


def _exports_and_tests_the_average(root: Path, tmp_path: Path, capsys) -> None:
    straight, resumed = (root / name / "checkpoints" / "iter_8.pth" for name in
                         ("straight", "resumed"))
    average = _export(straight, tmp_path / "a.pt", "--ema")
    assert average.keys() == _export(resumed, tmp_path / "b.pt", "--ema").keys()
    for name, tensor in _export(resumed, tmp_path / "b.pt", "--ema", "--force").items():
        assert torch.equal(tensor, average[name]), name
    trained = _export(straight, tmp_path / "c.pt")
    assert average.keys() == trained.keys()
    assert not torch.equal(average["net.0.weight"], trained["net.0.weight"])

    # tools/test.py scores the average: on the validation split it gives step 8's accuracy
    val_split = ["data.test.split=val"]
    capsys.readouterr()
    assert test_tool.main([str(root / "straight" / "config.yaml"), str(straight),
                           "--launcher", "none", "--cfg-options", *val_split]) == 0
    _, err = capsys.readouterr()
    assert "EMA: testing the average of the weights" in err
    logged = (root / "straight.log").read_text()
    (val_line,) = [line for line in logged.splitlines() if "validation at step 8" in line]
    accuracy = val_line.rsplit("accuracy ", 1)[1]
    assert f"test: accuracy {accuracy}" in err, err


def test_export_ema_of_a_run_without_the_hook_is_refused(tmp_path, capsys):
    checkpoint = tmp_path / "plain.pth"
    torch.save({"model": {"w": torch.ones(2)}, "hooks": {}}, checkpoint)
    assert export_main([str(checkpoint), str(tmp_path / "out.pt"), "--ema"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(f"error: --ema: {checkpoint} holds no EMA weights (the run "
                                f"that wrote it had no EMA hook)"), err
    assert not (tmp_path / "out.pt").exists()
