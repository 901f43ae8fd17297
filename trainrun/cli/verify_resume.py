"""``trainrun verify-resume`` (``tools/verify_resume.py``): prove that a config resumes
exactly, before a long job.

    python tools/verify_resume.py CONFIG [--nproc N] [--steps S] [--cfg-options KEY=VALUE ...]
                                  [--work-dir DIR] [--keep]

Three runs of ``trainrun train`` with the same config and options, S steps each: *straight*
through; *interrupted*, SIGKILLed (launcher and workers) as soon as its step-S/2 checkpoint is
saved; and *resumed* from that checkpoint with ``--resume``. Every step's logged values (the
loss at full float precision in ``metrics.jsonl``) must be equal with ``==``, steps 1 to S/2
from the interrupted run and the rest from the resumed one, and so must the last validation.
A straight run that stops by itself before step S (early stopping) is judged up to its stop:
killed after the checkpoint half way there, the resumed run must stop at the same step.

Exit codes: 0 exact; 1 not exact, or a run failed (its last output lines on stderr); 2 a bad
config or command line (one ``error:`` line, no traceback); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainrun.checkpoint.manager import LAST
from trainrun.checkpoint.manifest import is_sidecar
from trainrun.cli import TRAIN, HelpFormatter, epilog, import_from_working_directory, prog
from trainrun.cli.processes import process_tree
from trainrun.dist.launch import free_port
from trainrun.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from trainrun.messages import error_line
from trainrun.runner.config import ConfigError, load_config
from trainrun.runner.hooks.logger import NOT_REPRODUCIBLE
from trainrun.runner.run_dir import RunDir, is_resume_mark

EXIT_EXACT, EXIT_DIFFERENT = EXIT_OK, EXIT_FAILED  # this tool's verdicts
POLL_SECONDS = 0.002  # how often the interrupted run's checkpoints/last is looked for
# wall-clock times, throughput and memory differ in every run
NOT_COMPARED = ("step", "mode", *NOT_REPRODUCIBLE)
FOLLOWING = 3  # steps shown after the first one that differs
_STEP_IN_NAME = re.compile(r"(?:^|_)(?:iter|epoch)_(\d+)")
CAUSES_BEFORE = ("likely causes: unseeded randomness or non-deterministic ops "
                 "(try randomness.deterministic: true)")
CAUSES_AFTER = ("likely causes: a random generator the checkpoint does not save, a data order "
                "that does not resume, non-deterministic ops (randomness.deterministic: true), "
                "or, under ddp on 3 or more processes, gradients summed in another order after "
                "the resume (strategy.find_unused_parameters: true; see docs/checkpoints.md)")


class RunFailed(Exception):
    """A training run that exited with an error; ``log`` holds its output."""

    def __init__(self, phase: str, returncode: int, log: Path):
        super().__init__(f"the {phase} run failed (exit {returncode})")
        self.log = log


@dataclass
class Plan:
    """What to run: the config, its options for every run, and how many processes and steps."""

    config: str
    options: list[str]
    nproc: int
    steps: int
    work_dir: str | None
    keep: bool
    # the step the straight run stopped at by itself (early stopping) before `steps`; the
    # resume is then judged over steps 1 to it, killed after its middle
    stopped_at: int | None = None

    @property
    def end(self) -> int:
        """The last step the runs are compared at."""
        return self.stopped_at or self.steps

    @property
    def half(self) -> int:
        return self.end // 2

    @property
    def launcher(self) -> str:
        return "none" if self.nproc == 1 else "pytorch"


# ---------------------------------------------------------------- command line

def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("verify-resume", "verify_resume.py"),
        description="Train S steps straight, then S/2 + SIGKILL + --resume to S, and check that\n"
                    "the logged losses are bit-for-bit identical. schedule.max_iters,\n"
                    "checkpoint.interval, logging and resume are set by this tool.",
        formatter_class=HelpFormatter,
        epilog=epilog("trainrun verify-resume configs/digits_single.yaml",
                      "trainrun verify-resume CONFIG --nproc 2 --cfg-options strategy.type=fsdp",
                      docs="checkpoints"))
    p.add_argument("config", metavar="CONFIG", help="the YAML config")
    p.add_argument("--nproc", type=_at_least(1), default=1, metavar="N",
                   help="processes per run (default 1; more: torchrun)")
    p.add_argument("--steps", type=_at_least(2), default=20, metavar="S",
                   help="steps per run, killed after step S/2 (default 20)")
    p.add_argument("--cfg-options", nargs="+", action="extend", default=[],
                   metavar="K=V", help="overrides for every run, e.g. strategy.type=fsdp")
    p.add_argument("--work-dir", metavar="DIR",
                   help="where the runs go (default: a temporary dir)")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    return p


def defaults(steps: int) -> list[str]:
    """Options given before the user's, who may change them: validation at the end only (an
    interval meant in epochs would count steps under max_iters)."""
    return [f"schedule.val_interval={steps}"]


def forced(steps: int) -> list[str]:
    """Options given after the user's: S steps, a checkpoint every S/2 kept until the end,
    every step in metrics.jsonl, and a fresh start (``--resume`` wins over ``resume``)."""
    return [f"schedule.max_iters={steps}", "schedule.max_epochs=null",
            f"checkpoint.interval={steps // 2}", "checkpoint.max_keep=-1",
            "logging.interval=1", "logging.backends=[console,jsonl]", "resume=false"]


def replaced(user_options: Sequence[str], steps: int) -> list[str]:
    """The user's options whose keys the tool sets itself (after them, so they lose)."""
    keys = {option.split("=", 1)[0] for option in forced(steps)}
    return [option for option in user_options if option.split("=", 1)[0].strip() in keys]


def make_plan(argv: Sequence[str] | None = None) -> Plan:
    """Parse the command line and validate the config as the runs will see it.

    Raises SystemExit for argparse's usage errors and ConfigError for a bad config.
    """
    args = parser().parse_args(argv)
    plan = Plan(args.config, [*defaults(args.steps), *args.cfg_options, *forced(args.steps)],
                args.nproc, args.steps, args.work_dir, args.keep)
    warnings: list[str] = []
    load_config(plan.config, plan.options, values={"launcher": plan.launcher},
                on_warning=warnings.append)
    for option in replaced(args.cfg_options, args.steps):
        warnings.append(f"--cfg-options {option} is replaced: this tool sets "
                        f"{option.split('=', 1)[0].strip()} itself")
    for warning in warnings:
        _say(f"warning: {warning}", err=True)
    return plan


# ---------------------------------------------------------------- processes

def train_command(plan: Plan, run_dir: Path, resume: bool = False) -> list[str]:
    """``trainrun train`` for ``run_dir``: alone for one process, else under torchrun."""
    train = [*TRAIN, plan.config, "--launcher", plan.launcher, "--work-dir", str(run_dir)]
    if resume:
        train.append("--resume")
    train += ["--cfg-options", *plan.options]
    if plan.stopped_at is not None:  # the kill's checkpoint before the run's own stop
        train.append(f"checkpoint.interval={plan.half}")
    if plan.nproc == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(plan.nproc),
            "--master_port", str(free_port()), *train]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all below it at once, as a machine failure would: every process is
    stopped first (a stopped process starts no other) until the tree stops growing."""
    stopped: set[int] = set()
    while new := process_tree(pid) - stopped:
        for each in new:
            _signal(each, signal.SIGSTOP)
        stopped |= new
    for each in stopped:
        _signal(each, signal.SIGKILL)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (Ctrl-C here does not reach it; `finish` kills
    it), its output going to ``log`` after the command line."""
    with open(log, "w", encoding="utf-8") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the job ``proc`` started, unless it has ended, and reap it."""
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait()


def finish(proc: subprocess.Popen) -> int:
    """Wait for ``proc`` to end; if the wait is interrupted (Ctrl-C), kill the job."""
    try:
        return proc.wait()
    finally:
        stop(proc)


def kill_after_checkpoint(proc: subprocess.Popen, checkpoints: Path) -> bool:
    """SIGKILL the job as soon as ``checkpoints/last`` appears (its first checkpoint is saved);
    False if the job ended by itself first."""
    last = checkpoints / LAST
    try:
        while not last.exists():
            if proc.poll() is not None:
                return False
            time.sleep(POLL_SECONDS)
    finally:
        stop(proc)
    return proc.returncode == -signal.SIGKILL


# ---------------------------------------------------------------- run directories

def checkpoint_step(name: str) -> int | None:
    """The step in a checkpoint's name (``iter_10.pth``, ``best_accuracy_iter_20.pth``)."""
    found = _STEP_IN_NAME.search(name)
    return int(found.group(1)) if found else None


def rewind(checkpoints: Path, step: int) -> list[str]:
    """Make the step-``step`` checkpoint the newest again, as if the kill had come before any
    later one was saved; returns the names removed. Raises RuntimeError if it is missing."""
    kept = [p.name for p in checkpoints.glob(f"iter_{step}.*") if not is_sidecar(p.name)]
    if not kept:
        raise RuntimeError(f"no iter_{step} checkpoint in {checkpoints}")
    removed = []
    for entry in sorted(checkpoints.iterdir()):
        if entry.name != LAST and (checkpoint_step(entry.name) or 0) > step:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
    (checkpoints / LAST).write_text(kept[0] + "\n", encoding="utf-8")
    return removed


def after_resume(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a resumed run added to metrics.jsonl: those after its resume mark (the
    resume took out what the interrupted run logged after the checkpoint, and left the mark);
    every record where there is no mark."""
    marks = [i for i, record in enumerate(records) if is_resume_mark(record)]
    return records[marks[-1] + 1:] if marks else records


def by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Training records by step, without what differs in every run (the times)."""
    return {r["step"]: {k: v for k, v in r.items() if k not in NOT_COMPARED}
            for r in records if "mode" not in r and "step" in r}


def last_validation(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last validation record, or None if the run validated nothing."""
    found = [r for r in records if r.get("mode") == "val"]
    return found[-1] if found else None


# ---------------------------------------------------------------- comparing

@dataclass
class Mismatch:
    """The first logged value that differs: at ``step`` (None: the validation), ``key``."""

    step: int | None
    key: str
    straight: Any
    other: Any


_MISSING = object()


def first_mismatch(straight: dict[str, Any], other: dict[str, Any],
                   step: int | None) -> Mismatch | None:
    """The first key whose values differ (``==``: bit for bit), the loss first; a key missing
    on one side differs too."""
    keys = sorted(set(straight) | set(other), key=lambda k: (k != "loss", k))
    for key in keys:
        if key in NOT_COMPARED:
            continue
        a, b = straight.get(key, _MISSING), other.get(key, _MISSING)
        if a is _MISSING or b is _MISSING or a != b:
            return Mismatch(step, key, a, b)
    return None


def compare_steps(straight: dict[int, dict[str, Any]], other: dict[int, dict[str, Any]],
                  steps: range) -> Mismatch | None:
    """The first mismatch over ``steps``; a step one run did not log differs."""
    for step in steps:
        if step not in straight or step not in other:
            return Mismatch(step, "step", step if step in straight else _MISSING,
                            step if step in other else _MISSING)
        mismatch = first_mismatch(straight[step], other[step], step)
        if mismatch is not None:
            return mismatch
    return None


def _show(value: Any) -> str:
    return "missing" if value is _MISSING else repr(value)


def describe(mismatch: Mismatch, other: str) -> str:
    """``step 11: straight 2.30 vs resumed 2.31`` (the key named unless it is the loss)."""
    where = "validation" if mismatch.step is None else f"step {mismatch.step}"
    key = "" if mismatch.key == "loss" else f"{mismatch.key}: "
    return f"{where}: {key}straight {_show(mismatch.straight)} vs {other} {_show(mismatch.other)}"


def following(straight: dict[int, dict[str, Any]], other: dict[int, dict[str, Any]],
              mismatch: Mismatch, label: str, last: int) -> list[str]:
    """The same value at the few steps after the first mismatch, to show how far apart."""
    if mismatch.step is None:
        return []
    lines = []
    for step in range(mismatch.step + 1, min(mismatch.step + FOLLOWING, last) + 1):
        a = straight.get(step, {}).get(mismatch.key, _MISSING)
        b = other.get(step, {}).get(mismatch.key, _MISSING)
        lines.append("  " + describe(Mismatch(step, mismatch.key, a, b), label)
                     + (" (equal)" if a == b and a is not _MISSING else ""))
    return lines


# ---------------------------------------------------------------- the three runs

def _say(message: str, err: bool = False) -> None:
    print(message, file=sys.stderr if err else sys.stdout, flush=True)


def run_straight(plan: Plan, root: Path) -> list[dict[str, Any]]:
    """Phase 1: S steps without a stop; returns its metrics records."""
    run_dir, log = root / "straight", root / "straight.log"
    _say(f"straight: training steps 1-{plan.steps} ...")
    began = time.monotonic()
    returncode = finish(start(train_command(plan, run_dir), log))
    if returncode != 0:
        raise RunFailed("straight", returncode, log)
    _say(f"straight: done in {time.monotonic() - began:.1f} s")
    return RunDir(run_dir).read_metrics()


def run_interrupted(plan: Plan, root: Path) -> list[dict[str, Any]]:
    """Phase 2: the same run, SIGKILLed once its step-S/2 checkpoint is saved, then rewound to
    that checkpoint; returns its records."""
    run_dir, log = root / "resumed", root / "interrupted.log"
    _say(f"interrupted: training, to be killed after the step-{plan.half} checkpoint ...")
    began = time.monotonic()
    proc = start(train_command(plan, run_dir), log)
    checkpoints = RunDir(run_dir).checkpoints
    killed = kill_after_checkpoint(proc, checkpoints)
    if not killed and proc.returncode != 0:
        raise RunFailed("interrupted", proc.returncode, log)
    records = RunDir(run_dir).read_metrics()
    reached = max(by_step(records), default=0)
    how = "killed with SIGKILL" if killed else "ended by itself before the kill could land"
    _say(f"interrupted: {how} after step {reached} ({time.monotonic() - began:.1f} s)")
    removed = rewind(checkpoints, plan.half)
    if removed:
        _say(f"interrupted: removed the later {', '.join(removed)}, so that the step-"
             f"{plan.half} checkpoint is the newest")
    return records


def run_resumed(plan: Plan, root: Path) -> list[dict[str, Any]]:
    """Phase 3: ``--resume`` in the interrupted run's directory, to step S; returns the
    records it added to metrics.jsonl."""
    run_dir, log = root / "resumed", root / "resumed.log"
    _say(f"resumed: training steps {plan.half + 1}-{plan.end} from the checkpoint ...")
    began = time.monotonic()
    returncode = finish(start(train_command(plan, run_dir, resume=True), log))
    if returncode != 0:
        raise RunFailed("resumed", returncode, log)
    _say(f"resumed: done in {time.monotonic() - began:.1f} s")
    return after_resume(RunDir(run_dir).read_metrics())


# ---------------------------------------------------------------- verdicts

def not_exact(mismatch: Mismatch, straight: dict[int, dict[str, Any]],
              other: dict[int, dict[str, Any]], label: str, plan: Plan, why: str,
              causes: str) -> int:
    _say(f"resume is NOT exact: {describe(mismatch, label)}")
    for line in following(straight, other, mismatch, label, plan.end):
        _say(line)
    _say(why)
    _say(causes)
    return EXIT_DIFFERENT


def check_rerun(plan: Plan, straight: dict[int, dict[str, Any]],
                interrupted: dict[int, dict[str, Any]]) -> int | None:
    """Steps 1 to S/2 of the interrupted run against the straight one: differences there are
    not the resume's; returns the exit code if they differ."""
    mismatch = compare_steps(straight, interrupted, range(1, plan.half + 1))
    if mismatch is None:
        return None
    why = (f"the runs part at step {mismatch.step}, before the step-{plan.half} checkpoint: "
           f"the same config trained twice already differs, resume aside")
    return not_exact(mismatch, straight, interrupted, "interrupted", plan, why, CAUSES_BEFORE)


def check_resumed(plan: Plan, straight: dict[int, dict[str, Any]],
                  resumed: dict[int, dict[str, Any]]) -> int | None:
    """Steps S/2+1 to S of the resumed run against the straight one; returns the exit code if
    they differ, or if the resumed run did not start where the checkpoint stopped."""
    first = min(resumed, default=None)
    if first != plan.half + 1:
        began = "logged no step" if first is None else f"began at step {first}"
        _say(f"resume is NOT exact: the resumed run {began}, not at step {plan.half + 1}: it "
             f"did not continue from the step-{plan.half} checkpoint")
        return EXIT_DIFFERENT
    mismatch = compare_steps(straight, resumed, range(plan.half + 1, plan.end + 1))
    if mismatch is None and max(resumed) != plan.end:
        _say(f"resume is NOT exact: the resumed run trained to step {max(resumed)}; the "
             f"straight one stopped by itself at step {plan.end}")
        return EXIT_DIFFERENT
    if mismatch is None:
        return None
    why = (f"steps 1-{plan.half} match, so the step-{plan.half} checkpoint does not restore "
           f"everything the losses depend on")
    return not_exact(mismatch, straight, resumed, "resumed", plan, why, CAUSES_AFTER)


def check_validation(plan: Plan, straight: dict[str, Any] | None,
                     resumed: dict[str, Any] | None) -> int | None:
    """The last validation of both runs (if the straight run validated); returns the exit
    code if it differs."""
    if straight is None:
        return None
    mismatch = first_mismatch(straight, resumed or {}, None)
    if mismatch is not None:
        _say(f"resume is NOT exact: {describe(mismatch, 'resumed')} (the losses match)")
        _say(CAUSES_AFTER)
        return EXIT_DIFFERENT
    values = ", ".join(f"{k} {v!r}" for k, v in straight.items() if k not in NOT_COMPARED)
    _say(f"validation at step {straight.get('step')}: {values} in both runs")
    return None


def verify(plan: Plan, root: Path) -> int:
    """The three runs under ``root`` and the verdict; returns the exit code."""
    processes = "1 process" if plan.nproc == 1 else f"{plan.nproc} processes (torchrun)"
    _say(f"verify_resume: {plan.config}, {plan.steps} steps on {processes}, killed after the "
         f"step-{plan.half} checkpoint and resumed; runs in {root}")
    straight = run_straight(plan, root)
    expected = by_step(straight)
    plan = judged_until(plan, max(expected, default=0))
    interrupted = run_interrupted(plan, root)
    code = check_rerun(plan, expected, by_step(interrupted))
    if code is not None:
        return code
    resumed = run_resumed(plan, root)
    code = check_resumed(plan, expected, by_step(resumed))
    if code is None:
        code = check_validation(plan, last_validation(straight), last_validation(resumed))
    if code is not None:
        return code
    _say(f"exact resume: the losses of steps 1-{plan.end} match bit for bit"
         + (f", and both runs stopped by themselves at step {plan.end}"
            if plan.stopped_at else ""))
    return EXIT_EXACT


def judged_until(plan: Plan, last: int) -> Plan:
    """``plan`` for a straight run that logged ``last`` steps: as it was if it trained them
    all; else (it stopped by itself: early stopping) judged over steps 1 to ``last``."""
    if last >= plan.steps:
        return plan
    if last < 2:
        raise RuntimeError(f"the straight run stopped by itself at step {last}: too soon for "
                           f"a checkpoint to resume from before its stop")
    plan = replace(plan, stopped_at=last)
    _say(f"straight: stopped by itself at step {last} of {plan.steps}: the resume is judged "
         f"over steps 1-{last}, killed after the step-{plan.half} checkpoint")
    return plan


# ---------------------------------------------------------------- main

def run_root(plan: Plan) -> tuple[Path, bool]:
    """The directory the runs go in, and whether it is a temporary one. Raises ConfigError if
    ``--work-dir`` already holds runs."""
    if plan.work_dir is None:
        return Path(tempfile.mkdtemp(prefix="verify_resume-")), True
    root = Path(plan.work_dir)
    for name in ("straight", "resumed"):
        if (root / name).exists():
            raise ConfigError(f"--work-dir: {root / name} exists; expected a new or empty "
                              f"directory")
    root.mkdir(parents=True, exist_ok=True)
    return root, False


def _report_failure(error: RunFailed, keep: bool) -> int:
    """The failed run's own one-line error first (``trainrun train``'s ``error:`` line: a damaged
    checkpoint, a bad option), which torchrun's report at the end may push out of the tail;
    then the last lines of its output."""
    # the log's first line is the command
    lines = error.log.read_text(encoding="utf-8", errors="replace").splitlines()[1:]
    said = next((line for line in lines if line.startswith("error: ")), None)
    _say(f"error: {error}" + (f": {said.removeprefix('error: ')}" if said else ""), err=True)
    _say("its last lines:", err=True)
    for line in lines[-20:]:
        _say(f"  {line}", err=True)
    if not keep:
        _say("(run again with --keep to look at the run directories)", err=True)
    return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """``tools/verify_resume.py``: returns the exit code."""
    import_from_working_directory()
    try:
        plan = make_plan(argv)
        root, temporary = run_root(plan)
    except SystemExit as exit_:  # argparse: usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except ConfigError as error:
        _say(error_line(error), err=True)
        return EXIT_USAGE
    keep = plan.keep or not temporary
    try:
        return verify(plan, root)
    except RunFailed as error:
        return _report_failure(error, keep)
    except RuntimeError as error:
        _say(f"error: {error}", err=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        _say("interrupted", err=True)
        return EXIT_INTERRUPTED
    finally:
        if keep:
            _say(f"run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
