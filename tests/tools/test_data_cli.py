"""The data options of issue 13 through the command line, as a user runs them: a collate
function named in the config, several validation sets and iterable data sets, under torchrun
where ranks matter. Bad values of these keys are among tests/tools/test_bad_input.py's cases."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from torch.utils.data import default_collate

from tests.cli import CONFIG as DIGITS
from tests.cli import TRAIN, env, run, torchrun
from tests.records import train_records, val_records
from tests.tools.models import VariableLengthSequences

MODELS = "tests.tools.models"


def sequences(seed: int, size: int, **options) -> dict:
    return {"type": f"{MODELS}.VariableLengthSequences", "size": size, "seed": seed,
            "batch_size": 8, **options}


def write_config(path: Path, **changes) -> Path:
    """A small config over variable-length sequences, padded by ``pad_sequences``."""
    pad = {"type": "pad_sequences", "pad_value": -1}
    cfg = {
        "name": "sequences",
        "model": {"type": f"{MODELS}.MaskedMeanClassifier", "pad_value": -1},
        "data": {"train": sequences(0, 64, collate_fn=pad),
                 "val": sequences(1, 30, collate_fn=pad, metrics=["accuracy"])},
        "optim": {"type": "AdamW", "lr": 0.01},
        "schedule": {"max_iters": 8, "val_interval": 4},
        "logging": {"interval": 2},
        "checkpoint": {"interval": 4},
        **changes,
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_toy_sequences_need_padding():
    """Torch's own collate cannot batch them: the runs below train only through the
    config's collate_fn."""
    data = VariableLengthSequences(size=8)
    assert len({len(item["tokens"]) for item in data}) > 1
    with pytest.raises(RuntimeError):
        default_collate([data[i] for i in range(8)])


@pytest.mark.slow
def test_a_padding_collate_trains_variable_length_sequences_on_two_ranks(tmp_path):
    config = write_config(tmp_path / "sequences.yaml")
    work_dir = tmp_path / "run"
    done = run(torchrun(str(config), "--launcher", "pytorch", "--work-dir", str(work_dir)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in train_records(work_dir)] == [2, 4, 6, 8]
    assert [r["step"] for r in val_records(work_dir)] == [4, 8]
    assert all(0 <= r["accuracy"] <= 1 for r in val_records(work_dir))


def test_the_plan_names_the_collate_function(tmp_path):
    config = write_config(tmp_path / "sequences.yaml")
    done = subprocess.run([sys.executable, str(TRAIN), str(config), "--dry-run",
                           "--work-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60, env=env())
    assert done.returncode == 0, done.stderr
    assert "collate_fn pad_sequences (pad_value=-1)" in done.stdout, done.stdout
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- several validation sets

def two_val_sets(**first) -> dict:
    pad = {"type": "pad_sequences", "pad_value": -1}
    return {"train": sequences(0, 64, collate_fn=pad),
            "val": {"short": sequences(1, 30, collate_fn=pad, metrics=["accuracy"], **first),
                    "long": sequences(2, 20, collate_fn=pad, max_length=30)}}


@pytest.mark.slow
def test_several_validation_sets_are_logged_by_name_and_one_keeps_the_best(tmp_path):
    config = write_config(tmp_path / "sets.yaml", data=two_val_sets(),
                          checkpoint={"interval": 0, "save_best": "val/long/accuracy"})
    work_dir = tmp_path / "run"
    done = run(torchrun(str(config), "--launcher", "pytorch", "--work-dir", str(work_dir)))
    assert done.returncode == 0, done.stderr[-3000:]
    records = val_records(work_dir)
    assert [r["step"] for r in records] == [4, 8]
    assert all(set(r) == {"step", "mode", "val/short/accuracy", "val/long/accuracy"}
               for r in records)
    assert "val/short/accuracy" in done.stderr and "val/long/accuracy" in done.stderr
    best = list((work_dir / "checkpoints").glob("best_val_long_accuracy_iter_*.pth"))
    assert len(best) == 1, sorted(p.name for p in (work_dir / "checkpoints").iterdir())


def test_the_plan_lists_each_validation_set(tmp_path):
    config = write_config(tmp_path / "sets.yaml", data=two_val_sets())
    done = subprocess.run([sys.executable, str(TRAIN), str(config), "--dry-run"],
                          capture_output=True, text=True, timeout=60, env=env())
    assert done.returncode == 0, done.stderr
    assert "every 4 iterations on 2 sets, logged as val/<name>/<metric>:" in done.stdout
    assert "val/short  tests.tools.models.VariableLengthSequences" in done.stdout, done.stdout
    assert "metrics: accuracy)" in done.stdout and "metrics: the data set's default)" in done.stdout


# ---------------------------------------------------------------- iterable data sets

STREAM = "data.train.type=tests.tools.models.StatefulDigitsStream"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_with_state_resumes_exactly_after_sigkill_on_two_ranks(tmp_path, workers):
    """verify-resume on the digits config with data.train a stream that saves its place:
    the run killed after its step-4 checkpoint, resumed, logs the straight run's losses.
    (A stream that restarted would feed the resumed run other batches.)"""
    done = run([sys.executable, "-m", "trainrun", "verify-resume", str(DIGITS), "--nproc", "2",
                "--steps", "8", "--work-dir", str(tmp_path), "--cfg-options", STREAM,
                "data.train.shuffle=false", f"data.train.num_workers={workers}"], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the kill follows the step-4 checkpoint; a step or two may finish before it lands (CI
    # once saw step 5), but it must land mid-run, before the last step
    killed = re.search(r"^interrupted: killed with SIGKILL after step (\d+)", done.stdout,
                       re.MULTILINE)
    assert killed and 4 <= int(killed.group(1)) < 8, done.stdout
    assert "/iter_4.pth at epoch 1, step 4" in (tmp_path / "resumed.log").read_text()
    assert "exact resume: the losses of steps 1-8 match bit for bit" in \
        done.stdout.splitlines(), done.stdout


@pytest.mark.slow
def test_a_stream_without_state_is_warned_about_once_at_start(tmp_path):
    work_dir = tmp_path / "run"
    done = run(torchrun(str(DIGITS), "--launcher", "pytorch", "--work-dir", str(work_dir),
                        "--cfg-options", "data.train.type=tests.tools.models.DigitsStream",
                        "schedule.max_iters=4", "logging.interval=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "WARNING data.train" in line]
    assert len(said) == 2, done.stderr[-3000:]  # on rank 0 only
    assert "data.train.shuffle is ignored: tests.tools.models.DigitsStream is an " \
           "IterableDataset" in said[0]
    assert "data.train: tests.tools.models.DigitsStream has no state_dict()/load_state_dict(): " \
           "a resumed run reads the stream again" in said[1]
    assert [r["step"] for r in train_records(work_dir)] == [2, 4]
