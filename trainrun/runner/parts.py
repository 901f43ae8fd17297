"""Building a runner's parts from their config sections, while the runner is built.

The runner's constructor takes every part as an object or as its config section
(`runner_arguments` gives them from a validated config); `PartBuilder` turns the sections into
the parts (data loaders, metrics, the strategy, the schedule and its schedulers, the hooks),
checking each section by its table as ``from_cfg``'s config already is, and refusing before
anything is written what the run cannot use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from trainrun.messages import first_line
from trainrun.runner.builder import (
    build_dataloader,
    build_metrics,
    check_batches,
    check_loader,
    check_set_name,
    named_sets,
    unsized_epochs,
)
from trainrun.runner.config import check_compile, strategy_options
from trainrun.runner.evaluation import BaseMetric
from trainrun.runner.hooks import CheckpointHook, Hook, LoggerHook, PreemptionHook, ValidationHook
from trainrun.runner.hooks.checkpoint import check_best_metric, check_checkpoint_section
from trainrun.runner.hooks.from_config import build_hook, check_built_hook
from trainrun.runner.optim import build_scheduler, optimizer_factory, wrap_optimizers
from trainrun.runner.schema import ConfigError
from trainrun.runner.stream import is_sized, is_stream, stream_warnings
from trainrun.wrappers import Strategy, build_strategy

if TYPE_CHECKING:
    from trainrun.runner.runner import Runner


def runner_arguments(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The runner's constructor arguments from a config loaded and validated by
    ``trainrun.runner.config``: its sections as plain values (the chosen strategy's options
    only), and the config itself as ``cfg``."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) \
        else dict(cfg)
    data = plain.get("data") or {}
    return dict(
        model=plain["model"],
        work_dir=plain["work_dir"],
        train_dataloader=data.get("train"),
        val_dataloader=data.get("val"),
        test_dataloader=data.get("test"),
        optim=plain.get("optim"),
        scheduler=plain.get("scheduler"),
        strategy={"type": plain["strategy"]["type"], **strategy_options(cfg)},
        precision=plain["precision"],
        compile=plain.get("compile", False),
        schedule=plain["schedule"],
        randomness=plain["randomness"],
        logging=plain["logging"],
        checkpoint=plain["checkpoint"],
        preemption=plain["preemption"],
        guard=plain.get("guard"),
        hooks=plain.get("hooks") or [],
        resume=plain["resume"],
        load_from=plain["load_from"],
        launcher=plain["launcher"],
        backend=plain["backend"],
        dist_timeout=plain["dist_timeout"],
        cfg=cfg,
    )


class PartBuilder:
    """Builds the parts of ``runner`` from their sections, with what it holds so far.

    Args:
        runner: the runner being built: its ``cfg`` (None: built from objects, so what a
            section's check warns about is logged here; for a config, ``load_config`` said it
            when it read the file), ``seed``, ``rank``, ``world_size`` and ``logger``; hooks
            are checked against it as it is when they are built.
    """

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def section(self, check: Callable[..., dict[str, Any]], key: str,
                value: Mapping[str, Any] | None) -> dict[str, Any]:
        """A section given to the runner checked and completed by its table, as `from_cfg`'s
        are already; what the check warns about is logged (for a config, `load_config` said
        it when it read the file)."""
        warnings: list[str] = []
        out = check(key, value, warnings=warnings)
        self._log_warnings(warnings)
        return out

    def _log_warnings(self, warnings: list[str]) -> None:
        for warning in warnings if self.runner.cfg is None else ():  # else said by the config
            self.runner.logger.warning(warning)

    def warn_once(self, message: str) -> None:
        """A warning every rank finds alike (about the config and the model), said by rank 0."""
        if self.runner.rank == 0:
            self.runner.logger.warning(message)

    def log_groups(self, lines: list[str]) -> None:
        """Log the optimiser's parameter groups (``optim.paramwise``), on rank 0."""
        if self.runner.rank == 0:
            self.runner.logger.info("parameter groups (optim.paramwise):\n  %s",
                                    "\n  ".join(lines))

    # ------------------------------------------------------------------ data and metrics

    def loader(self, loader: Any, split: str, key: str | None = None) -> DataLoader | None:
        """``loader`` itself, or the loader its data section describes (None: none)."""
        if loader is None or isinstance(loader, DataLoader):
            return loader
        key = key or f"data.{split}"
        section = self.section(partial(check_loader, split=split), key, loader)
        built = build_dataloader(section, self.runner.seed, split == "train", key=key,
                                 ranks=self.data_ranks())
        if is_stream(built) and self.runner.rank == 0:
            for warning in stream_warnings(key, section, built.dataset.dataset):
                self.runner.logger.warning(warning)
        return built

    def data_ranks(self) -> tuple[int, int]:
        """This rank's place among the ranks the data is dealt to, and their number: tensor-
        parallel peers (the strategy's ``model_parallel_size`` consecutive ranks) share one."""
        peers = self.runner.strategy.model_parallel_size
        return self.runner.rank // peers, self.runner.world_size // peers

    def val_loaders(self, loaders: Any) -> DataLoader | dict[str, DataLoader] | None:
        """The validation loader, or for several validation sets (a mapping of names to
        loaders or data sections) a dict of them."""
        if not named_sets(loaders):
            return self.loader(loaders, "val")
        return {check_set_name("data.val", name): self.loader(loader, "val", f"data.val.{name}")
                for name, loader in loaders.items()}

    def check_train_batches(self, loader: DataLoader | None, section: Any) -> None:
        """A training set the config describes (``section``) that leaves no batch in
        ``loader`` is refused (every rank finds the same) before the run directory is
        written."""
        if is_stream(loader):
            if is_sized(loader) and len(loader) == 0:
                raise ConfigError(f"data.train: the stream's {len(loader.dataset.dataset)} "
                                  f"items leave no batch of {loader.batch_size} for each of "
                                  f"{self.runner.world_size} process(es) x "
                                  f"{loader.dataset.workers} worker(s)")
            return
        if isinstance(section, Mapping) and loader is not None and len(loader) == 0:
            check_batches("data.train", len(loader.dataset), self.data_ranks()[1],
                          loader.batch_size, loader.drop_last)

    def val_metrics(self, metrics: Sequence[BaseMetric] | Mapping[str, Sequence[BaseMetric]]
                    | None, sections: Any) -> list[BaseMetric] | dict[str, list[BaseMetric]]:
        """The validation metrics of the runner's validation loaders; for several sets a dict
        of them by set: from ``metrics`` (a dict by set name, or one list every set is scored
        with in turn), else from each set's section or data set."""
        loaders = self.runner.val_dataloader
        if not isinstance(loaders, dict):
            return self.metrics(metrics, sections, loaders, "data.val")
        if isinstance(metrics, Mapping) and set(metrics) - set(loaders):
            raise ValueError(f"val_metrics names sets {sorted(set(metrics) - set(loaders))} "
                             f"that val_dataloader does not have ({', '.join(loaders)})")
        return {name: self.metrics(metrics.get(name) if isinstance(metrics, Mapping)
                                   else metrics, sections[name], loader, f"data.val.{name}")
                for name, loader in loaders.items()}

    @staticmethod
    def metrics(metrics: Sequence[BaseMetric] | None, section: Any, loader: DataLoader | None,
                key: str) -> list[BaseMetric]:
        """``metrics``, else those the data section ``key`` names, else its data set's."""
        if metrics is not None:
            return list(metrics)
        if loader is None:
            return []
        return build_metrics(section if isinstance(section, Mapping) else None, loader.dataset,
                             key)

    # ------------------------------------------------------------------ strategy and schedule

    @staticmethod
    def strategy(strategy: str | Mapping[str, Any] | Strategy) -> Strategy:
        """``strategy`` itself, or the one its name or section describes."""
        if isinstance(strategy, Strategy):
            return strategy
        if isinstance(strategy, str):
            return build_strategy(strategy)
        options = dict(strategy)
        return build_strategy(options.pop("type"), **options)

    def wrapped_model(self, model: nn.Module, optim: Mapping[str, Any] | Callable[..., Any]
                      | None, compile: bool | Mapping[str, Any], precision: str
                      ) -> tuple[nn.Module, Any, Any]:
        """The model as the runner's strategy wraps it (compiled where ``compile`` asks), the
        optimiser the strategy builds over it from the ``optim`` section or function (None
        without training data), and the optimiser wrapper ``train_step`` gets: the strategy's
        own, else the runner's ``OptimWrapper``."""
        runner, strategy = self.runner, self.runner.strategy
        compile = check_compile("compile", compile)
        strategy.use_compile(compile or None)
        make_optimizer = optimizer_factory(optim, self.warn_once, self.log_groups) \
            if isinstance(optim, Mapping) else optim
        if runner.train_dataloader is None:
            make_optimizer = None
        optim_cfg = optim if isinstance(optim, Mapping) else {}
        strategy.configure(getattr(runner.train_dataloader, "batch_size", None), optim_cfg,
                           precision)
        try:
            model, optimizer = strategy.setup(model, runner.device, make_optimizer)
        except ValueError as error:  # an option the model refuses (a wrap class it lacks, a
            # tp plan it has none of): as the dry run says it, before anything is written
            raise ConfigError(first_line(error)) from error
        optim_wrapper = strategy.optim_wrapper(model, optimizer)
        if optimizer is not None and optim_wrapper is None:
            optim_wrapper = wrap_optimizers(optimizer, optim_cfg, precision, runner.device.type)
        return model, optimizer, optim_wrapper

    @staticmethod
    def schedule_length(schedule: Mapping[str, Any], loader: DataLoader | None
                        ) -> tuple[bool, int, int]:
        """Whether the checked ``schedule`` counts epochs, and the epochs and iterations it
        trains over the training ``loader``."""
        by_epoch = schedule["max_iters"] is None
        if loader is not None and not is_sized(loader):  # a stream without a length
            if by_epoch:
                unsized_epochs(type(loader.dataset.dataset).__name__, None)
            loader = None
        steps_per_epoch = len(loader) if loader else 0
        if by_epoch:
            return True, schedule["max_epochs"], schedule["max_epochs"] * steps_per_epoch
        max_iters = schedule["max_iters"]
        return False, -(-max_iters // steps_per_epoch) if steps_per_epoch else 0, max_iters

    @staticmethod
    def schedulers(cfg: Mapping[str, Any] | Callable[[Any, int], Any] | None, optimizer: Any,
                   max_iters: int) -> list[Any]:
        """The learning-rate schedulers the ``scheduler`` section describes (or a function
        makes), one per optimiser; none without it or without an optimiser."""
        if not cfg or optimizer is None:
            return []
        optimizers = optimizer.values() if isinstance(optimizer, Mapping) else [optimizer]
        if callable(cfg):
            return [cfg(opt, max_iters) for opt in optimizers]
        try:
            return [build_scheduler(opt, dict(cfg), max_iters) for opt in optimizers]
        except ValueError as error:  # its messages name the key: a config that cannot run
            raise ConfigError(str(error)) from None

    # ------------------------------------------------------------------ checkpoints and hooks

    def checkpoint_section(self, value: Mapping[str, Any] | None) -> dict[str, Any]:
        """The ``checkpoint`` section, checked; its ``save_best`` must name a validation set's
        metric where there are several sets."""
        checkpoint = self.section(check_checkpoint_section, "checkpoint", value)
        loaders = self.runner.val_dataloader
        check_best_metric("checkpoint.save_best", checkpoint["save_best"],
                          list(loaders) if isinstance(loaders, dict) else None)
        return checkpoint

    def extra_hooks(self, hooks: Sequence[Hook | Mapping[str, Any]]) -> list[Hook]:
        """The hooks given, those described by a config's ``hooks`` items built, each checked
        against the built run (`Hook.check`); a refusal is a ConfigError naming the item."""
        built: list[Hook] = []
        for i, hook in enumerate(hooks):
            key = f"hooks[{i}]"
            if isinstance(hook, Mapping):
                warnings: list[str] = []
                hook = build_hook(key, hook, warnings)
                self._log_warnings(warnings)
            check_built_hook(key, hook, self.runner)
            built.append(hook)
        return built

    def hooks(self, extra: Sequence[Hook], logging: dict[str, Any], checkpoint: dict[str, Any],
              val_interval: int, val_begin: int = 1) -> list[Hook]:
        """Every hook of the run in the order they run (by ``priority``): the built-in ones
        (the runner's timer, logging, its guard, validation, checkpoints, preemption) and
        ``extra``."""
        runner = self.runner
        hooks: list[Hook] = [runner.timer, LoggerHook(logging["interval"], logging["backends"],
                                                      step_metrics=logging["step_metrics"],
                                                      window=logging["window"],
                                                      straggler_floor=logging["straggler_floor"])]
        if runner.guard is not None:
            hooks.append(runner.guard)
        if runner.val_dataloader is not None:
            hooks.append(ValidationHook(val_interval, val_begin))
        if runner.train_dataloader is not None:
            hooks.append(CheckpointHook(checkpoint["interval"], checkpoint["save_last"],
                                        checkpoint["save_best"], checkpoint["best_rule"],
                                        checkpoint["async"]))
            hooks.append(PreemptionHook())
        hooks.extend(extra)
        return sorted(hooks, key=lambda hook: hook.priority)
