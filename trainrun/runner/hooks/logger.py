"""Training and validation numbers to the console, metrics.jsonl and TensorBoard.

Every ``interval`` iterations the logged values are averaged over the ranks (one small
collective on every rank) and rank 0 writes them. On a terminal rank 0 also shows a progress
bar with loss, throughput and ETA; headless (cluster logs) it prints plain lines instead.
"""

from __future__ import annotations

import datetime
import importlib.util
import sys
import time
from typing import Any

from trainrun.dist import all_reduce_dict, is_main_process
from trainrun.runner.hooks.base import LOGGER, Hook, every
from trainrun.runner.logging import get_logger
from trainrun.runner.schema import choice, fields, integer, names

INTERVAL = 10  # iterations between logged lines
BACKENDS = ("console", "jsonl")  # where they go by default
LOG_BACKENDS = ("console", "jsonl", "tensorboard")


def _number(value: Any) -> float:
    return value.item() if hasattr(value, "item") else float(value)


class LoggerHook(Hook):
    priority = LOGGER  # see hooks/base.py for the order

    def __init__(self, interval: int = INTERVAL, backends: list[str] | None = None,
                 progress_bar: bool | None = None):
        self.interval = interval
        self.backends = list(backends or BACKENDS)
        show_bar = sys.stderr.isatty() if progress_bar is None else progress_bar
        self.progress_bar = show_bar and "console" in self.backends and is_main_process()
        self._bar = None
        self._tensorboard = None
        self._started: tuple[float, int] | None = None  # (clock, step) when training began
        self._last_val: dict[str, float] = {}

    def before_train(self, runner: Any) -> None:
        self._started = (time.monotonic(), runner.iter)
        if "tensorboard" in self.backends and is_main_process():
            self._tensorboard = self._open_tensorboard(runner)
        if self.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=runner.max_iters, initial=runner.iter, unit="it",
                             dynamic_ncols=True, file=sys.stderr)

    def _open_tensorboard(self, runner: Any) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            get_logger().warning("logging.backends has tensorboard but it is not installed "
                                 "(pip install tensorboard); skipping it")
            return None
        return SummaryWriter(log_dir=str(runner.work_dir / "tensorboard"))

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(1)
        if not (every(runner.iter, self.interval) or runner.iter == runner.max_iters):
            return
        # every rank takes part; a copy, so that later hooks see this rank's own outputs
        values = all_reduce_dict(dict(outputs), op="mean")
        if not is_main_process():
            return
        record = {"step": runner.iter, "epoch": runner.epoch + 1,
                  **{k: _number(v) for k, v in values.items()}, "lr": runner.optim_wrapper.get_lr()}
        timer = runner.timer
        record.update(time=timer.iter_time, data_time=timer.data_time)
        if "jsonl" in self.backends:
            runner.metrics_file.write(record)
        if self._tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "epoch"):
                    self._tensorboard.add_scalar(f"train/{key}", value, runner.iter)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        self._log(self._train_line(runner, record))

    def _log(self, message: str) -> None:
        """To train.log always; to the console when it is a backend and no progress bar is
        drawn there (validation lines are written above the bar)."""
        if self._bar is not None and message.startswith("validation"):
            self._bar.write(message)
        quiet = self._bar is not None or "console" not in self.backends
        get_logger().info(message, extra={"file_only": quiet})

    def _train_line(self, runner: Any, record: dict[str, Any]) -> str:
        eta = datetime.timedelta(seconds=round(runner.timer.eta_seconds(runner.max_iters
                                                                         - runner.iter)))
        values = "  ".join(f"{k} {v:.6g}" for k, v in record.items()
                           if k not in ("step", "epoch", "lr", "time", "data_time"))
        epochs = f"epoch {record['epoch']}/{runner.max_epochs}  " if runner.by_epoch else ""
        return (f"{epochs}step {runner.iter}/{runner.max_iters}  {values}  "
                f"lr {record['lr']:.3e}  {record['time']:.3f} s/it  eta {eta}")

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        self._last_val = dict(metrics)
        if not is_main_process():
            return
        record = {"step": runner.iter, "mode": "val", **metrics}
        if "jsonl" in self.backends:
            runner.metrics_file.write(record)
        if self._tensorboard is not None:
            several = isinstance(runner.val_dataloader, dict)  # keys: val/<set>/<metric>
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key if several else f"val/{key}", value,
                                             runner.iter)
        text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._log(f"validation at step {runner.iter}: {text}")

    def after_test(self, runner: Any, metrics: dict[str, float]) -> None:
        if is_main_process():
            text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            get_logger().info(f"test: {text}")

    def after_run(self, runner: Any) -> None:
        """One closing line: how far, how long, the last validation, where the run lives."""
        if not is_main_process() or self._started is None:
            return
        seconds, first_step = time.monotonic() - self._started[0], self._started[1]
        done = f"training done: step {runner.iter}/{runner.max_iters}"
        if runner.iter > first_step:
            done += (f" ({runner.iter - first_step} steps in "
                     f"{datetime.timedelta(seconds=round(seconds))})")
        if self._last_val:
            done += "; last validation " + "  ".join(f"{k} {v:.4f}"
                                                     for k, v in self._last_val.items())
        get_logger().info(f"{done}; run directory {runner.work_dir}")

    def after_train(self, runner: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def check_logging(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    """The ``logging`` section; tensorboard is dropped with a warning where it is not
    installed."""
    out = fields(key, value, {
        "interval": (INTERVAL, integer(1)),
        "backends": (list(BACKENDS), names(choice(*LOG_BACKENDS))),
    })
    if "tensorboard" in out["backends"] and importlib.util.find_spec("tensorboard") is None:
        out["backends"].remove("tensorboard")
        warnings.append(f"{key}.backends: tensorboard is not installed (pip install "
                        f"tensorboard); its logs are skipped")
    return out
