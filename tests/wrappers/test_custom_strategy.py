"""A strategy written entirely here, plus one registry line (and one for its checkpoint
format), gets what the shipped ones get: training from a config through the Runner, exact
resume after a crash, export, the dry run's plan and option checking. It is DDP whose
checkpoint is a directory with one file per rank (docs/own-strategy.md walks through it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.records import losses
from tests.runner.toy import straight_crash_resume
from tests.runs import shared_run
from trainrun.checkpoint.files import save_state_file
from trainrun.checkpoint.torch_file import TorchFile
from trainrun.cli import export as export_tool
from trainrun.cli import train as train_tool
from trainrun.dist import barrier, get_rank
from trainrun.registry import FORMATS
from trainrun.runner import Runner
from trainrun.runner.config import load_config
from trainrun.wrappers import STRATEGIES, DDPStrategy


class PerRankDDP(DDPStrategy):
    """DDP; a checkpoint is a directory where every rank writes ``rank_<r>.pt`` itself."""

    name = "per_rank_ddp"
    WRITER_RANK = re.compile(r"^rank_(\d+)\.pt$")  # who writes (and hashes) which file
    FORMAT = "per_rank_files"  # its checkpoints' format (PerRankFiles, below), by name

    def save_checkpoint(self, path: str, model: Any, optimizer: Any,
                        extra: dict[str, Any]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        save_state_file(str(Path(path) / f"rank_{get_rank()}.pt"),
                        self._whole_state(model, optimizer, extra))
        barrier()


class PerRankFiles(TorchFile):
    """The format: whether a path is one of these checkpoints, and how to read one (rank 0's
    file holds the whole state, as every rank's does)."""

    name = "per_rank_files"

    @classmethod
    def owns(cls, path: Path) -> bool:
        return path.is_dir() and (path / "rank_0.pt").is_file()

    @classmethod
    def look_inside(cls, path: Path) -> None:
        super().look_inside(path / "rank_0.pt")

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        return super().read_state(path / "rank_0.pt")

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        return super().model_shapes(path / "rank_0.pt")


CONFIG = """\
model: {type: tests.runner.toy.ToyModel}
data:
  train: {type: tests.runner.toy.ToyRegression, size: 32, batch_size: 4}
strategy: {type: per_rank_ddp, bucket_cap_mb: 1}
optim: {type: SGD, lr: 0.01, momentum: 0.9}
schedule: {max_iters: 12}
logging: {interval: 1, backends: [jsonl]}
checkpoint: {interval: 4}
"""



def _train_crash_resume(config: str, root: str) -> list[str]:
    """On every rank: a straight run, and one that crashes after step 6 then resumes."""
    STRATEGIES["per_rank_ddp"] = PerRankDDP  # the registry lines, in this worker process
    FORMATS["per_rank_files"] = PerRankFiles
    try:
        def runner(name: str, **more: Any) -> Runner:
            return Runner.from_cfg(load_config(config, [f"work_dir={root}/{name}"],
                                               values=more))

        straight_crash_resume(runner)
        return sorted(p.name for p in (Path(root) / "crashed/checkpoints/iter_4.pth").iterdir())
    finally:
        del STRATEGIES["per_rank_ddp"], FORMATS["per_rank_files"]


@shared_run
def custom_strategy_run(run_on, tmp_path_factory):
    """The straight and the crashed-then-resumed run, trained once a session (here, not in
    tests/runs.py: docs/own-strategy.md shows the code they run from this file)."""
    root = tmp_path_factory.mktemp("custom")
    config = root / "per_rank.yaml"
    config.write_text(CONFIG)
    files = run_on(2)(_train_crash_resume, str(config), str(root))
    return root, config, files


def test_it_trains_from_a_config_and_resumes_exactly(custom_strategy_run):
    root, _, files = custom_strategy_run
    assert files[0] == files[1] == ["SHA256SUMS", "rank_0.pt", "rank_1.pt"]  # its own format
    # it resumed from its own checkpoint of step 4 (a restart from step 0 logs the same losses)
    log = (root / "crashed" / "train.log").read_text()
    assert re.search(r"resumed from \S+/iter_4\.pth at epoch 1, step 4\n", log), log
    straight, resumed = losses(root / "straight"), losses(root / "crashed")
    assert sorted(resumed) == list(range(1, 13)) and resumed == straight  # bit for bit


def test_it_exports_and_shows_in_the_plan_and_checks_its_options(custom_strategy_run, tmp_path,
                                                                  monkeypatch, capsys):
    root, config, _ = custom_strategy_run
    checkpoint = root / "straight" / "checkpoints" / "iter_12.pth"
    out = tmp_path / "model.safetensors"
    assert export_tool.main([str(checkpoint), str(out)]) == 2  # unregistered: not a checkpoint
    assert "not a checkpoint" in capsys.readouterr().err
    monkeypatch.setitem(FORMATS, "per_rank_files", PerRankFiles)  # the format's line, here
    assert export_tool.main([str(checkpoint), str(out)]) == 0
    saved = torch.load(checkpoint / "rank_0.pt", weights_only=True)["model"]
    exported = load_file(out)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)

    monkeypatch.setitem(STRATEGIES, "per_rank_ddp", PerRankDDP)  # the strategy's, here
    assert train_tool.main([str(config), "--dry-run", "--work-dir", str(tmp_path / "x")]) == 0
    assert re.search(r"strategy\s+per_rank_ddp", capsys.readouterr().out)
    assert train_tool.main([str(config), "--dry-run", "--cfg-options",
                            "strategy.bucket_cap=1"]) == 2
    assert "strategy.bucket_cap" in capsys.readouterr().err
