"""The dry run and the memory plan in tests: a refusal's one line, and a plan set beside what
a run's ranks hold."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from trainrun.cli.plan import main as plan_main
from trainrun.runner.config import load_config
from trainrun.runner.memory_watch import watch_memory
from trainrun.runner.plan import plan_memory
from trainrun.runner.runner import Runner
from trainrun.wrappers.memory import KINDS


def dry_run_error(capsys: pytest.CaptureFixture, config: str | os.PathLike,
                  options: list[str], world_size: int = 4) -> str:
    """``trainrun plan CONFIG --world-size N --cfg-options OPTIONS``, which must exit 2 with
    one error line; its standard error."""
    code = plan_main([str(config), "--world-size", str(world_size), "--cfg-options", *options])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1, err
    return err


def plan_and_measure(config: str, overrides: list[str], work_dir: str) -> tuple[dict, dict]:
    """On every rank: the plan for this job's size, and the peak this rank held by kind over
    2 training steps."""
    cfg = load_config(config, [*overrides, f"work_dir={work_dir}"])
    plan = plan_memory(OmegaConf.to_container(cfg, resolve=True),
                       torch.distributed.get_world_size())
    with Runner.from_cfg(cfg) as runner:
        watch = watch_memory(runner)
        runner.train()
        watch.close()
    assert watch.steps == 2
    return ({kind: plan.kind(kind) for kind in KINDS},
            {kind: watch.peak.kind(kind) for kind in KINDS})
