"""The built-in examples: registry lookups, data splits, and every shipped config training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cli import env
from trainrun.cli.train import main as train_main
from trainrun.dist.launch import free_port
from trainrun.examples import digits
from trainrun.examples.digits import DigitsDataset
from trainrun.examples.tinylm import CharCorpus
from trainrun.registry import resolve

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def train(config: Path, work_dir: Path, *options: str, nproc: int = 2) -> list[dict]:
    """Train ``config`` (under torchrun when ``nproc`` > 1); the records of metrics.jsonl."""
    if nproc > 1:
        start = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                 "--master_port", str(free_port())]
        launcher = "pytorch"
    else:
        start, launcher = [sys.executable], "none"
    done = subprocess.run([*start, str(REPO / "tools" / "train.py"), str(config), "--launcher",
                           launcher, "--work-dir", str(work_dir),
                           *(["--cfg-options", *options] if options else [])],
                          capture_output=True, text=True, timeout=300, env=env())
    assert done.returncode == 0, done.stderr[-4000:]
    lines = (work_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# ---------------------------------------------------------------- registry

def test_resolve_short_names_and_import_paths():
    assert resolve("model", "DigitsMLP").__name__ == "DigitsMLP"
    assert resolve("model", "trainrun.examples.digits.DigitsMLP") is resolve("model", "DigitsMLP")
    assert resolve("model", "trainrun.examples.digits:DigitsMLP") is resolve("model", "DigitsMLP")
    metric = resolve("metric", "val_loss")()
    assert metric.name == "val_loss"


@pytest.mark.parametrize(("kind", "name", "words"), [
    ("model", "DigitMLP", ["DigitsMLP", "did you mean"]),
    ("dataset", "digit", ["'digits'"]),
    ("model", "trainrun.examples.digits.DigitsMLq", ["has no attribute", "DigitsMLP"]),
    ("model", "no_such_package.Model", ["no module named 'no_such_package'"]),
    ("optimizer", "AdamW", ["kinds are"]),
])
def test_resolve_errors_name_the_choices(kind, name, words):
    with pytest.raises(ValueError) as error:
        resolve(kind, name)
    for word in words:
        assert word in str(error.value)


# ---------------------------------------------------------------- data

def test_digit_splits_are_disjoint_and_cover_the_set():
    options = {"val_fraction": 0.2, "test_fraction": 0.1, "split_seed": 0}
    splits = {name: DigitsDataset(name, **options) for name in ("train", "val", "test")}
    assert [len(s) for s in splits.values()] == [1258, 359, 180]
    rows = {name: {tuple(x.tolist()) for x in s.inputs} for name, s in splits.items()}
    assert not rows["train"] & rows["val"] and not rows["train"] & rows["test"]
    item = splits["train"][0]
    assert item["inputs"].shape == (64,) and item["labels"].dtype == torch.int64
    assert 0.0 <= float(splits["train"].inputs.min()) and float(splits["train"].inputs.max()) <= 1


def test_digits_read_from_the_file_equal_scikit_learns_load_digits(monkeypatch):
    """The file read gives load_digits' arrays exactly; where the file is not found, the
    fallback through load_digits gives them too."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels, labels = digits.read_digits()
    assert np.array_equal(pixels, bunch.data) and pixels.dtype == bunch.data.dtype
    assert np.array_equal(labels, bunch.target) and labels.dtype == np.int64
    monkeypatch.setattr(digits, "DIGITS_FILE", Path("no", "such", "file.csv.gz"))
    pixels, labels = digits.read_digits()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)


def test_digits_load_without_importing_scikit_learn():
    """Every process of a digits run reads the data; importing scikit-learn would cost each
    about a second."""
    code = ("import sys; from trainrun.examples.digits import DigitsDataset; "
            "n = len(DigitsDataset('train')); print(n, 'sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1438", "False"]


def test_char_corpus_targets_are_inputs_shifted_and_splits_do_not_overlap():
    train = CharCorpus("train", block_size=32)
    val = CharCorpus("val", block_size=32)
    item = train[3]
    assert item["inputs"].shape == item["labels"].shape == (32,)
    assert torch.equal(item["inputs"][1:], item["labels"][:-1])
    assert len(train) > 8 * len(val) > 0  # val_fraction 0.1 of the text
    assert int(train.tokens.max()) < 97 and int(val.tokens.max()) < 97


# ---------------------------------------------------------------- shipped configs

@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_dry_runs(config, tmp_path, capsys):
    """In this process, as tools/train.py runs it (the command line's own process is tested
    in tests/tools/test_train_cli.py)."""
    code = train_main([str(config), "--dry-run", "--work-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "plan for" in out and "effective" in out
    assert not (tmp_path / "run").exists()


# trained on two processes elsewhere: digits_ddp by the quick start below, hf_gpt2_fsdp by
# tests/examples/test_hf_gpt2.py (20 steps, the same checks)
TRAINED_ELSEWHERE = ("digits_single", "digits_ddp", "hf_gpt2_fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.stem not in TRAINED_ELSEWHERE],
                         ids=lambda p: p.stem)
def test_every_shipped_config_trains_a_few_steps_on_two_processes(config, tmp_path):
    """(Without the config's scheduler: a warmup longer than these 4 steps is refused.)"""
    records = train(config, tmp_path, "schedule.max_epochs=null", "schedule.max_iters=4",
                    "schedule.val_interval=4", "logging.interval=2", "checkpoint.interval=4",
                    "scheduler=null")
    assert [r["step"] for r in records if "mode" not in r] == [2, 4]
    assert [r["step"] for r in records if r.get("mode") == "val"] == [4]
    assert (tmp_path / "checkpoints" / "last").read_text().strip() == "iter_4.pth"


@pytest.mark.slow
def test_quick_start_reaches_095_validation_accuracy(tmp_path):
    """`make train`'s job, as shipped."""
    records = train(REPO / "configs" / "digits_ddp.yaml", tmp_path)
    assert max(r["accuracy"] for r in records if r.get("mode") == "val") >= 0.95
    assert [r for r in records if r.get("mode") == "val"][-1]["accuracy"] >= 0.95


@pytest.mark.slow
def test_single_process_config_reaches_095(tmp_path):
    records = train(REPO / "configs" / "digits_single.yaml", tmp_path, nproc=1)
    assert [r for r in records if r.get("mode") == "val"][-1]["accuracy"] >= 0.95
