"""The Hugging Face example: CharLines' pieces, HFGPT2's loss over unpadded tokens, the
shipped configs/hf_gpt2_fsdp.yaml training on 2 processes (no network), resuming exactly after
a crash, and the config errors (transformers missing, a bad model option)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli import env
from tests.records import losses, records
from tests.runner.toy import straight_crash_resume
from trainrun.cli.train import main as train_main
from trainrun.dist.launch import free_port
from trainrun.examples.hf_gpt2 import HFGPT2
from trainrun.examples.tinylm import NEWLINE_ID, CharLines
from trainrun.registry import resolve
from trainrun.runner import Runner
from trainrun.runner.collate import pad_sequences
from trainrun.runner.config import load_config

REPO = Path(__file__).resolve().parents[2]
FSDP = REPO / "configs" / "hf_gpt2_fsdp.yaml"

# ---------------------------------------------------------------- the data


def test_char_lines_cut_the_text_once_into_whole_lines_of_varying_length():
    pieces = CharLines("train", block_size=64, min_length=16)
    offsets = pieces.offsets
    assert offsets[0] == 0 and len(pieces.tokens) - 1 <= offsets[-1] <= len(pieces.tokens)
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    assert all(17 <= size <= 65 for size in sizes[:-1]) and sizes[-1] >= 2
    ends = pieces.tokens[offsets[1:-1] - 1]  # each piece's last character, but the last's
    cut = torch.tensor(sizes[:-1]) == 65
    assert bool(((ends == NEWLINE_ID) | cut).all())  # a line break, else a too-long line
    assert 0.5 < float((ends == NEWLINE_ID).float().mean()) and len(set(sizes[:-1])) == 49
    item = pieces[3]
    assert len(item["inputs"]) == sizes[3] - 1 and item["inputs"].dtype == torch.int64
    assert torch.equal(item["inputs"][1:], item["labels"][:-1])
    val = CharLines("val", block_size=64, min_length=16)
    assert len(pieces) > 8 * len(val) > 0  # the text's last 10%: CharCorpus's split


def test_char_lines_refuse_a_min_length_outside_the_block():
    with pytest.raises(ValueError, match="min_length must be between 1 and block_size"):
        CharLines("train", block_size=16, min_length=17)


# ---------------------------------------------------------------- the model


def _batch(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in lengths:
        ids = torch.randint(0, 97, (length + 1,), generator=generator)
        samples.append({"inputs": ids[:-1], "labels": ids[1:]})
    return samples


def test_padding_changes_no_sample_loss():
    """A padded batch scores each sample as it scores alone; padded labels count nothing."""
    torch.manual_seed(0)
    model = HFGPT2(block_size=16, n_layer=1, n_head=2, n_embd=16).eval()
    samples = _batch([16, 5, 11])
    batch = pad_sequences(samples, pad_value=0)
    alone = torch.stack([model({k: v[None] for k, v in s.items()}, mode="predict")[0]
                         for s in samples])
    padded = model(batch, mode="predict")
    assert torch.allclose(padded, alone, atol=1e-5), (padded, alone)
    tokens = torch.tensor([16.0, 5, 11])
    expected = (alone * tokens).sum() / tokens.sum()  # the mean over real tokens
    assert torch.allclose(model(batch)["loss"], expected, atol=1e-5)
    batch["labels"] = batch["labels"].masked_fill(~batch["labels_mask"], 7)
    assert torch.allclose(model(batch, mode="predict"), padded)


def test_the_weights_come_from_the_seed():
    def built(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return HFGPT2(n_layer=1, n_embd=16).model.transformer.h[0].attn.c_attn.weight

    assert torch.equal(built(3), built(3)) and not torch.equal(built(3), built(4))
    assert resolve("model", "HFGPT2") is HFGPT2


# ---------------------------------------------------------------- the shipped config

# refuses (and writes down) any connection or name lookup that leaves this machine, in every
# Python process that starts with it on its path: torchrun and both ranks
NO_NETWORK = textwrap.dedent("""\
    import os, sys

    LOCAL = {None, "", "localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}

    def refuse(event, args):
        if event == "socket.connect":
            address = args[1]
            host = address[0] if isinstance(address, tuple) else None  # a str: AF_UNIX
        elif event == "socket.getaddrinfo":
            host = args[0]
        else:
            return
        host = host.decode() if isinstance(host, bytes) else host
        if host not in LOCAL:
            with open(os.environ["NETWORK_LOG"], "a") as log:
                log.write(f"{event} {host}\\n")
            raise OSError(f"no network in this test: {event} {host}")

    sys.addaudithook(refuse)
""")


def test_fsdp_config_trains_on_two_processes_without_network(tmp_path):
    """configs/hf_gpt2_fsdp.yaml made short: 20 steps, the loss falls, no address outside
    this machine is looked up or connected to. (This is the config's training on two processes
    of tests/examples/test_examples.py too.)"""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_NETWORK)
    network_log = tmp_path / "network.log"
    environment = env()
    environment["PYTHONPATH"] = f"{tmp_path / 'site'}:{environment['PYTHONPATH']}"
    environment["NETWORK_LOG"] = str(network_log)
    work_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(REPO / "tools" / "train.py"), str(FSDP),
         "--launcher", "pytorch", "--work-dir", str(work_dir), "--cfg-options",
         "schedule.max_iters=20", "schedule.val_interval=20", "checkpoint.interval=20",
         "scheduler.warmup_iters=5", "logging.interval=5"],
        capture_output=True, text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not network_log.exists(), network_log.read_text()
    loss = losses(work_dir)
    assert sorted(loss) == [5, 10, 15, 20] and loss[20] < loss[5] - 0.3 < 4.0, loss
    val = [r for r in records(work_dir) if r.get("mode") == "val"]
    assert [r["step"] for r in val] == [20] and val[0]["val_loss"] < 3.6  # chance: ln 97 = 4.57
    log = (work_dir / "train.log").read_text()
    assert "norm + bias: lr 0.002, weight_decay 0; 18 tensors" in log
    assert (work_dir / "checkpoints" / "iter_20.pth").is_dir()  # an fsdp (sharded) checkpoint
    assert (work_dir / "checkpoints" / "last").read_text().strip() == "iter_20.pth"


def _crash_and_resume(root: str) -> None:
    """On every rank: the shipped fsdp config for 8 small steps straight through, and a run
    that crashes after step 6 and resumes from step 4's checkpoint."""
    def runner(name: str, **more: Any) -> Runner:
        overrides = [f"work_dir={root}/{name}", "schedule.max_iters=8", "checkpoint.interval=4",
                     "scheduler.warmup_iters=3", "data.train.batch_size=8", "data.val=null",
                     "logging.interval=1", "logging.backends=[jsonl]"]
        return Runner.from_cfg(load_config(FSDP, overrides, values=more))

    straight_crash_resume(runner)


def test_fsdp_config_resumes_exactly_after_a_crash(run_on, tmp_path):
    run_on(2)(_crash_and_resume, str(tmp_path), timeout=240)
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "crashed")
    assert sorted(resumed) == list(range(1, 9)) and resumed == straight  # bit for bit
    assert "resumed from" in (tmp_path / "crashed" / "train.log").read_text()


# ---------------------------------------------------------------- config errors


def _refused(capsys: pytest.CaptureFixture, work_dir: Path, *argv: str) -> str:
    """The one error line of tools/train.py on the fsdp config (exit 2, nothing written)."""
    code = train_main([str(FSDP), "--launcher", "none", "--work-dir", str(work_dir), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not work_dir.exists()
    return err


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_without_transformers_the_model_is_refused_naming_the_extra(
        monkeypatch, capsys, tmp_path, dry_run):
    """``import transformers`` fails as where it is not installed (None in sys.modules makes
    the import system raise ModuleNotFoundError for it)."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "trainrun.examples.hf_gpt2")
    err = _refused(capsys, tmp_path / "run", *(["--dry-run"] if dry_run else []))
    assert err == ("error: model.type: model type 'HFGPT2' needs transformers, which is not "
                   "installed: pip install 'trainrun[hf]'")


def test_without_transformers_an_import_path_to_the_model_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "trainrun.examples.hf_gpt2")
    with pytest.raises(ValueError, match=r"^model type 'trainrun.examples.hf_gpt2:HFGPT2' "
                                         r"needs transformers, which is not installed: "
                                         r"pip install 'trainrun\[hf\]'"):
        resolve("model", "trainrun.examples.hf_gpt2:HFGPT2")


@pytest.mark.parametrize(("option", "words"), [
    ("model.n_head=3", "model: HFGPT2 refused its arguments: n_embd (128) must be a multiple "
                       "of n_head (3)"),
    ("model.n_heads=2", "unknown key 'model.n_heads'; did you mean 'model.n_head'?"),
], ids=["n_head", "unknown-key"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_bad_model_option_is_refused_naming_it(capsys, tmp_path, option, words, dry_run):
    err = _refused(capsys, tmp_path / "run", "--cfg-options", option,
                   *(["--dry-run"] if dry_run else []))
    assert err == f"error: {words}"
