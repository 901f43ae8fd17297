"""The runs the tests train once and share: session fixtures, registered for every test by
tests/conftest.py.

A fixture made with ``shared_run`` is computed once per session, and the tests that ask for it
are sent to one pytest-xdist worker (``--dist loadgroup``, as ``make test`` runs the suite),
so that the run is trained once per suite rather than once per worker. A test that needs one
of these runs asks for its fixture; it does not train the same run again.
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.cli import CONFIG, SHORT, SLOW, run, torchrun
from trainrun.runner.runner import Runner

RUN_FIXTURES: set[str] = set()  # the names of the fixtures made with ``shared_run``

F = TypeVar("F", bound=Callable[..., Any])


def shared_run(function: F) -> F:
    """Make ``function`` a session fixture whose tests share one xdist worker (the group is
    the fixture's name)."""
    RUN_FIXTURES.add(function.__name__)
    return pytest.fixture(scope="session")(function)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test that asks for a ``shared_run`` fixture ``xdist_group`` with the fixture's
    name: what ``--dist loadgroup`` reads to send them all to one worker (without xdist, or
    under another ``--dist``, the mark changes nothing)."""
    for item in items:
        for name in sorted(RUN_FIXTURES.intersection(item.fixturenames)):
            item.add_marker(pytest.mark.xdist_group(name))


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up: nothing trains
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` in a pytest-xdist worker, fail a test of a shared run whose
    group was not applied (pytest-xdist puts ``@group`` at the end of a grouped test's id):
    each shared run would train once per worker. pytest 9.2 with pytest-xdist 3.8 does that,
    hence ``pytest<9.2`` in pyproject.toml."""
    if item.config.getoption("loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail(f"--dist loadgroup did not group this test: this pytest "
                    f"({pytest.__version__}) and pytest-xdist do not work together (each "
                    f"shared run would train once per worker); see pyproject.toml",
                    pytrace=False)


# ---------------------------------------------------------------- digits under torchrun

@shared_run
def digits_run(tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, subprocess.CompletedProcess]:
    """digits_ddp for 2 epochs on 2 processes under torchrun (``SHORT``): the run directory, and
    the finished command (for its output)."""
    work_dir = tmp_path_factory.mktemp("cli") / "digits"
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir),
                        "--cfg-options", *SHORT))
    assert done.returncode == 0, done.stderr[-4000:]
    return work_dir, done


@shared_run
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Path]:
    """``straight()``: the work_dir of an uninterrupted ``SLOW`` ddp run, trained (at the first
    call) once for all the tests that compare a stopped and resumed job against it."""
    runs: list[tuple[Path, subprocess.CompletedProcess]] = []

    def straight() -> Path:
        if not runs:
            work_dir = tmp_path_factory.mktemp("straight") / "ddp"
            runs.append((work_dir, run(torchrun(str(CONFIG), "--launcher", "pytorch",
                                                "--work-dir", str(work_dir),
                                                "--cfg-options", *SLOW))))
        work_dir, done = runs[0]
        assert done.returncode == 0, done.stderr[-3000:]
        return work_dir

    return straight


# ---------------------------------------------------------------- compile

COMPILE_STEPS = 19  # the first epoch's full batches (the 20th is smaller: another compile)


@shared_run
def compile_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped digits config, ``COMPILE_STEPS`` steps on 2 processes, uncompiled (``plain``)
    and compiled (``compiled``): the directory holding both."""
    root = tmp_path_factory.mktemp("compile")
    for name, compile_ in [("plain", "false"), ("compiled", "true")]:
        done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir",
                            str(root / name), "--cfg-options",
                            f"schedule.max_iters={COMPILE_STEPS}", "logging.interval=1",
                            "data.val=null", f"compile={compile_}"),
                   timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    return root


# ---------------------------------------------------------------- hooks from the config

# validation every 10 steps; accuracy cannot gain 0.5 on its first value (about 0.55), so the
# first validation stays the best and the third after it (step 40) stops the run
EARLY = "{type: EarlyStopping, metric: accuracy, patience: 3, min_delta: 0.5}"
COUNTER = "{type: tests.tools.models.CountingHook}"
PROFILER = "{type: Profiler, wait: 1, warmup: 1, active: 2, ranks: [0, 1]}"
HOOK_OPTIONS = ["schedule.max_epochs=null", "schedule.max_iters=200", "schedule.val_interval=10",
                "checkpoint.interval=10", "checkpoint.max_keep=-1", "logging.interval=1",
                "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.05"]


def hooks_command(work_dir: Path, *hooks: str, resume: bool = False) -> list[str]:
    """The digits config on 2 processes under torchrun with ``HOOK_OPTIONS`` and ``hooks``."""
    return torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir),
                    *(["--resume"] if resume else []), "--cfg-options", *HOOK_OPTIONS,
                    f"hooks=[{', '.join(hooks)}]")


@shared_run
def hooks_run(tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, subprocess.CompletedProcess]:
    """The hooks' run that nobody stops (``EARLY``, ``COUNTER``), with the profiler tracing steps
    3-4 on both ranks: the run directory and the finished command."""
    work_dir = tmp_path_factory.mktemp("hooks") / "straight"
    done = run(hooks_command(work_dir, EARLY, COUNTER, PROFILER))
    assert done.returncode == 0, done.stderr[-4000:]
    return work_dir, done


# ---------------------------------------------------------------- trackers

# 2 processes, batch 32 each: 20 steps an epoch; 10 steps, logged every 5
TRACKED_OPTIONS = ["schedule.max_epochs=null", "schedule.max_iters=10", "schedule.val_interval=10",
                   "checkpoint.interval=5", "logging.interval=5", "optim.lr=0.00125",
                   "data.train.type=tests.tools.trackers.DigitsWithTokens"]
# the recording tracker (tests/tools/trackers.py), then the trackers whose packages are here
TRACKED_BACKENDS = ["console", "jsonl", "tests.tools.trackers.RecordingTracker",
                    *(name for name in ("wandb", "mlflow") if importlib.util.find_spec(name))]


def tracked_command(work_dir: Path, *more: str) -> list[str]:
    """The digits config on 2 processes under torchrun with ``TRACKED_OPTIONS``, tracked by
    every backend of ``TRACKED_BACKENDS``."""
    return torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir), *more,
                    "--cfg-options", *TRACKED_OPTIONS,
                    f"logging.backends=[{','.join(TRACKED_BACKENDS)}]")


@shared_run
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run tracked by the recording tracker, W&B (offline) and MLflow (its file store) at
    once, each where installed: the run directory, which the tests only read."""
    work_dir = tmp_path_factory.mktemp("tracked") / "run"
    done = run(tracked_command(work_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    return work_dir


# ---------------------------------------------------------------- a checkpoint of each strategy

EXPORT_STRATEGIES = {"ddp": "ddp", "fsdp": "fsdp",
                     "zero3": {"type": "deepspeed", "zero_stage": 3}}


def _export_body(work_dir: str, strategy: Any) -> dict[str, torch.Tensor]:
    """Train 4 steps, checkpoint at the end; the whole weights the model ended with."""
    runner = Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                          "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01}, strategy=strategy,
        schedule={"max_iters": 4}, randomness={"seed": 3},
        logging={"interval": 1, "backends": []}, checkpoint={"interval": 4},
    )
    runner.train()
    state = {k: v.detach().clone() for k, v in runner.strategy.model_state_dict(
        runner.model).items()}
    runner.close()
    return state


@shared_run
def export_runs(tmp_path_factory: pytest.TempPathFactory, run_on: Callable
                ) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """One 2-rank run of the toy model per strategy of ``EXPORT_STRATEGIES``: its work_dir and
    its final weights."""
    base = tmp_path_factory.mktemp("export")
    out = {}
    for name, strategy in EXPORT_STRATEGIES.items():
        states = run_on(2)(_export_body, str(base / name), strategy)
        out[name] = (base / name, states[0])
    return out


# ---------------------------------------------------------------- tensor and pipeline parallelism

TINYLM = Path(__file__).resolve().parents[1] / "configs" / "tinylm_fsdp.yaml"
TP_STEPS = 40
TP_OPTIONS = [f"schedule.max_iters={TP_STEPS}", "schedule.val_interval=20",
              "checkpoint.interval=20", "logging.interval=1"]


@shared_run
def parallel_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shipped tinylm config for ``TP_STEPS`` steps, checkpointed at 20 and 40, on the same
    global batch: under fsdp with tp=2 on 4 processes (``tp``: 2 data-parallel ranks), with
    pp=2 on 4 (``pp``: 2 stages, 4 microbatches), and under ddp on 2 (``ddp``). Their run
    directories, by name."""
    root = tmp_path_factory.mktemp("parallel")
    runs = {"tp": (4, str(TINYLM), ["strategy.tp=2"]),
            "pp": (4, str(TINYLM), ["strategy.pp=2", "strategy.pp_microbatches=4"]),
            "ddp": (2, str(TINYLM.with_name("tinylm_ddp.yaml")), [])}
    for name, (nproc, config, options) in runs.items():
        done = run(torchrun(config, "--launcher", "pytorch", "--work-dir", str(root / name),
                            "--cfg-options", *TP_OPTIONS, *options, nproc=nproc), timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    return {name: root / name for name in runs}
