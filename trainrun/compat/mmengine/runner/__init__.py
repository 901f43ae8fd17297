"""``mmengine.runner``: ``Runner`` with MMEngine's constructor arguments and ``from_cfg``.

It translates MMEngine's arguments into trainrun's Runner (``trainrun.runner.runner.Runner``)
and is that Runner: the same loop, strategies, checkpoints, heartbeat and run-directory lock.
The translation keeps what decides MMEngine's numbers (see docs/mmengine.md): the seed before
the model is built, ``DefaultSampler``'s order, loaders that draw their base seed from the
global generator, MMEngine's worker seeds, its learning-rate schedulers stepped as its
hooks step them (``param_scheduler.py``), and a loss that is each rank's own. An argument or
option with no trainrun equivalent is refused with a ``ConfigError`` naming it; nothing is
ignored.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainrun.checkpoint.manager import LAST
from trainrun.compat.mmengine.checkpoint import MMEngineDDP, continue_as_mmengine, load_checkpoint
from trainrun.compat.mmengine.dataset import DefaultSampler, InfiniteSampler, pseudo_collate
from trainrun.compat.mmengine.evaluator import Evaluator
from trainrun.compat.mmengine.hooks import COMPAT_HOOKS, HookAdapter
from trainrun.compat.mmengine.param_scheduler import scheduler_factory
from trainrun.compat.mmengine.refusal import only, refused, type_name
from trainrun.compat.mmengine.registry import DATASETS, FUNCTIONS, HOOKS, RUNNERS
from trainrun.compat.mmengine.work_dir import LastCheckpointFile, MMEngineRunDir
from trainrun.dist import (
    broadcast,
    get_dist_info,
    infer_launcher,
    init_dist,
    is_distributed,
    sync_random_seed,
)
from trainrun.exits import EXIT_USAGE, say_refusal
from trainrun.messages import error_line, is_int
from trainrun.runner.hooks.base import Hook as TrainrunHook
from trainrun.runner.runner import Runner as TrainrunRunner
from trainrun.runner.schema import ConfigError, bad_value

# MMEngine's loop types and what trainrun's schedule calls them
LOOPS = {"EpochBasedTrainLoop": True, "IterBasedTrainLoop": False}
LOADER_KEYS = {"dataset", "sampler", "batch_size", "num_workers", "persistent_workers",
               "collate_fn", "pin_memory", "drop_last"}
# MMEngine's default hooks: the ones trainrun has an equivalent of read their options
DEFAULT_HOOK_TYPES = {"runtime_info": "RuntimeInfoHook", "timer": "IterTimerHook",
                      "sampler_seed": "DistSamplerSeedHook", "logger": "LoggerHook",
                      "param_scheduler": "ParamSchedulerHook", "checkpoint": "CheckpointHook"}
LOG_WINDOW = 10  # MMEngine's LogProcessor's window_size by default: its lines' values smoothed


def exit_2_on_refusal(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """``sys.excepthook`` while a script uses the compat Runner: a refusal nothing caught (a
    ``ConfigError``) ends the script as trainrun's command lines end: one line on stderr
    (from rank 0), exit code 2. Anything else goes to the hook that was there before.

    The line goes to the stderr the process started with: once a process group is joined,
    torch.distributed's own hook calls this one with ``sys.stderr`` swapped for a buffer that
    it prints only after this hook returns, which it never does."""
    if not issubclass(kind, ConfigError):
        _previous_hook(kind, error, trace)
        return
    first = os.environ.get("RANK", "0") == "0"  # every rank finds the same refusal
    say_refusal(error_line(error) if first else None, sys.__stderr__ or sys.stderr)
    sys.stdout.flush()
    os._exit(EXIT_USAGE)  # after an uncaught exception Python would exit 1


_previous_hook = sys.excepthook


# ---------------------------------------------------------------- loaders


def mmengine_worker_seed(worker_id: int, num_workers: int, rank: int, seed: int) -> None:
    """Seed a loader worker as MMEngine does: numpy, random and torch with
    ``num_workers * rank + worker_id + seed``."""
    worker_seed = num_workers * rank + worker_id + seed
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    torch.manual_seed(worker_seed)


def collate_function(key: str, value: Any) -> Callable:
    """The loader's ``collate_fn``: a callable, or ``dict(type=name or function)`` looked up
    in ``FUNCTIONS``; MMEngine's default ``pseudo_collate`` when absent."""
    if value is None:
        return pseudo_collate
    if callable(value):
        return value
    if isinstance(value, Mapping) and set(value) == {"type"}:
        function = value["type"]
        if callable(function):
            return function
        found = FUNCTIONS.get(function)
        if found is None:
            raise ConfigError(f"{key}.type: unknown function {function!r}; the known ones: "
                              f"{', '.join(FUNCTIONS.names())}")
        return found
    raise refused(key, value, "give a function or dict(type=<function name>)")


def check_shares(key: str, loader: DataLoader | None, strategy: str) -> None:
    """Refuse a ``DefaultSampler(round_up=False)`` where ranks with unequal shares would
    wait for each other: in training (a rank with one batch fewer leaves DDP's all-reduce
    waiting; MMEngine's loop does not guard against it either), and for validation or test
    data under a ``strategy`` other than ddp, whose forward needs every rank (fsdp gathers
    the sharded parameters; DeepSpeed's engine may)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DefaultSampler) or sampler.round_up:
        return
    if key == "train_dataloader":
        raise refused(f"{key}.sampler.round_up", False,
                      "ranks whose shares differ by a sample can train different numbers of "
                      "batches, which leaves DDP waiting; use round_up=False for "
                      "val_dataloader and test_dataloader")
    if strategy != "ddp":
        raise refused(f"{key}.sampler.round_up", False,
                      f"under trainrun's {strategy} strategy every forward needs every rank, "
                      "and ranks with unequal shares can run different numbers of batches; "
                      "use round_up=True (the padding is cut before the metrics) or "
                      "DDPStrategy")


class SyncedSeeds:
    """The seeds MMEngine gives samplers without one under ``diff_rank_seed``: its
    ``sync_random_seed()``, a draw from numpy's global generator on every rank (rank 0's
    is used), made as each loader is built, just after seeding with ``seed`` (rank 0's).

    Called, it gives the next draw; `replay` then makes the same draws from this rank's
    global generator, which MMEngine's loaders would have advanced.

    Args:
        seed: rank 0's seed.
    """

    def __init__(self, seed: int):
        self.generator = np.random.RandomState(seed % 2**32)
        self.taken = 0

    def __call__(self) -> int:
        self.taken += 1
        return int(self.generator.randint(2**31))

    def replay(self) -> None:
        for _ in range(self.taken):
            np.random.randint(2**31)


def build_loader(key: str, cfg: Any, seed: int, max_iters: int | None = None,
                 sampler_seed: Callable[[], int] | None = None) -> DataLoader | None:
    """A DataLoader from MMEngine's dataloader dict (or a DataLoader as it is): the data set
    (an object or a config dict for ``DATASETS``), its sampler (``DefaultSampler``;
    ``InfiniteSampler`` for the training data of an iteration-based run of ``max_iters``),
    no generator of its own (each pass draws its base seed from the global generator, as
    MMEngine's loaders do) and MMEngine's worker seeds from ``seed`` (this rank's).
    A sampler config without a seed gets ``sampler_seed()``, or ``seed`` when that is None."""
    if cfg is None or isinstance(cfg, DataLoader):
        return cfg
    if not isinstance(cfg, Mapping):
        raise refused(key, cfg, "give a dict or a DataLoader")
    only(key, cfg, LOADER_KEYS)
    dataset = cfg.get("dataset")
    if isinstance(dataset, Mapping):
        dataset = DATASETS.build(dataset)
    if dataset is None:
        raise ConfigError(f"{key}.dataset: missing")
    sampler_cfg = dict(cfg.get("sampler") or {"type": "DefaultSampler"})
    kind = type_name(sampler_cfg.pop("type", "DefaultSampler"))
    samplers = ("DefaultSampler", "InfiniteSampler") if max_iters else ("DefaultSampler",)
    if kind not in samplers:
        raise refused(f"{key}.sampler.type", kind, "use DefaultSampler" + (
            "" if max_iters else " (InfiniteSampler: for an iteration-based run's training)"))
    allowed = {"shuffle", "seed", "round_up"} if kind == "DefaultSampler" else {"shuffle", "seed"}
    only(f"{key}.sampler", sampler_cfg, allowed)
    if "seed" not in sampler_cfg:
        sampler_cfg["seed"] = seed if sampler_seed is None else sampler_seed()
    try:
        if kind == "DefaultSampler":
            sampler = DefaultSampler(dataset, **sampler_cfg)
        else:
            sampler = InfiniteSampler(dataset, samples=max_iters * cfg.get("batch_size", 1),
                                      **sampler_cfg)
    except ValueError as error:
        raise ConfigError(f"{key}.sampler: {error}") from None
    workers = cfg.get("num_workers", 0)
    rank, _ = get_dist_info()
    return DataLoader(
        dataset, batch_size=cfg.get("batch_size", 1), sampler=sampler,
        num_workers=workers, collate_fn=collate_function(f"{key}.collate_fn",
                                                         cfg.get("collate_fn")),
        pin_memory=cfg.get("pin_memory", False),
        persistent_workers=cfg.get("persistent_workers", False) and workers > 0,
        drop_last=cfg.get("drop_last", False),
        worker_init_fn=partial(mmengine_worker_seed, num_workers=workers, rank=rank, seed=seed)
        if workers > 0 else None)


# ---------------------------------------------------------------- optimiser and schedules


def optim_section(cfg: Any) -> tuple[dict[str, Any] | None, str]:
    """trainrun's ``optim`` section and ``precision`` from MMEngine's ``optim_wrapper``."""
    if cfg is None:
        return None, "fp32"
    if not isinstance(cfg, Mapping):
        raise refused("optim_wrapper", cfg, "give a dict")
    cfg = dict(cfg)
    kind = type_name(cfg.pop("type", "OptimWrapper"))
    if kind not in ("OptimWrapper", "AmpOptimWrapper", "DeepSpeedOptimWrapper"):
        raise refused("optim_wrapper.type", kind,
                      "use OptimWrapper, AmpOptimWrapper or (with DeepSpeedStrategy) "
                      "DeepSpeedOptimWrapper")
    precision = "fp32"
    if kind == "AmpOptimWrapper":
        dtype = cfg.pop("dtype", None)
        names = {None: "fp16", "float16": "fp16", torch.float16: "fp16",
                 "bfloat16": "bf16", torch.bfloat16: "bf16"}
        if dtype not in names:
            raise refused("optim_wrapper.dtype", dtype, "use 'float16' or 'bfloat16'")
        precision = names[dtype]
    only("optim_wrapper", cfg, {"optimizer", "clip_grad", "accumulative_counts",
                                "paramwise_cfg"})
    optimizer = dict(cfg.get("optimizer") or {})
    if "type" not in optimizer:
        raise ConfigError("optim_wrapper.optimizer.type: missing (e.g. dict(type='SGD', lr=0.1))")
    section: dict[str, Any] = {**optimizer, "type": type_name(optimizer["type"])}
    clip = cfg.get("clip_grad")
    if clip is not None:
        section["clip_grad"] = clip_grad_section(clip)
    section["accumulate"] = cfg.get("accumulative_counts", 1)
    if cfg.get("paramwise_cfg"):
        paramwise = dict(cfg["paramwise_cfg"])
        only("optim_wrapper.paramwise_cfg", paramwise,
             {"norm_decay_mult", "bias_decay_mult", "custom_keys"})
        section["paramwise"] = paramwise
    return section, precision


def clip_grad_section(cfg: Any) -> dict[str, Any]:
    """trainrun's ``optim.clip_grad`` from MMEngine's ``optim_wrapper.clip_grad``: the
    keyword arguments of ``clip_grad_norm_`` (type 'norm', the default) or of
    ``clip_grad_value_`` (type 'value'), which trainrun tells apart by ``max_norm`` or
    ``clip_value``."""
    if not isinstance(cfg, Mapping):
        raise refused("optim_wrapper.clip_grad", cfg, "give a dict")
    clip = dict(cfg)
    kind = clip.pop("type", "norm")
    if kind == "value":
        only("optim_wrapper.clip_grad", clip, {"clip_value", "foreach"})
        if "clip_value" not in clip:
            raise ConfigError("optim_wrapper.clip_grad.clip_value: missing (type='value' "
                              "clips each gradient value to [-clip_value, clip_value])")
    elif kind == "norm":
        if "clip_value" in clip:
            raise refused("optim_wrapper.clip_grad.clip_value", clip["clip_value"],
                          "type='norm' takes clip_grad_norm_'s arguments; clip by value with "
                          "type='value'")
    else:
        raise refused("optim_wrapper.clip_grad.type", kind, "use 'norm' or 'value'")
    return clip


# ---------------------------------------------------------------- hooks


def hook_sections(default_hooks: Mapping[str, Any] | None, by_epoch: bool
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """trainrun's ``checkpoint`` and ``logging`` sections from MMEngine's ``default_hooks``."""
    checkpoint: dict[str, Any] = {"interval": 1, "max_keep": -1}  # MMEngine's default hook
    logging: dict[str, Any] = {}
    for name, cfg in (default_hooks or {}).items():
        if name not in DEFAULT_HOOK_TYPES:
            raise refused(f"default_hooks.{name}", cfg,
                          f"the default hooks are {', '.join(DEFAULT_HOOK_TYPES)}")
        if cfg is None:
            raise refused(f"default_hooks.{name}", None, "trainrun's runs keep every default "
                          "hook (leave the entry out)")
        cfg = dict(cfg)
        kind = type_name(cfg.pop("type", DEFAULT_HOOK_TYPES[name]))
        if kind != DEFAULT_HOOK_TYPES[name]:
            raise refused(f"default_hooks.{name}.type", kind, f"use {DEFAULT_HOOK_TYPES[name]}")
        if name == "checkpoint":
            only("default_hooks.checkpoint", cfg,
                 {"interval", "by_epoch", "max_keep_ckpts", "save_last", "save_best", "rule"})
            if cfg.pop("by_epoch", by_epoch) != by_epoch:
                raise refused("default_hooks.checkpoint.by_epoch", not by_epoch,
                              "checkpoints count what the training loop counts")
            checkpoint = {"interval": cfg.get("interval", 1),
                          "max_keep": cfg.get("max_keep_ckpts", -1),
                          "save_last": cfg.get("save_last", True)}
            if cfg.get("save_best") is not None:
                checkpoint["save_best"] = cfg["save_best"]
                if cfg.get("rule"):
                    checkpoint["best_rule"] = cfg["rule"]
        elif name == "logger":
            only("default_hooks.logger", cfg, {"interval"})
            logging["interval"] = cfg.get("interval", 10)
        else:
            only(f"default_hooks.{name}", cfg, set())
    return checkpoint, logging


def log_window(log_processor: Any) -> int:
    """trainrun's ``logging.window`` from MMEngine's ``log_processor``: its ``window_size``,
    MMEngine's default 10 where it gives none or there is no ``log_processor``. ``by_epoch``
    (how MMEngine words a line) is taken and left: a line is trainrun's own; the other options
    are refused."""
    if log_processor is None:
        return LOG_WINDOW
    if not isinstance(log_processor, Mapping):
        raise refused("log_processor", log_processor, "give a dict")
    cfg = dict(log_processor)
    kind = type_name(cfg.pop("type", "LogProcessor"))
    if kind != "LogProcessor":
        raise refused("log_processor.type", kind, "use LogProcessor")
    only("log_processor", cfg, {"window_size", "by_epoch"})
    if not isinstance(cfg.get("by_epoch", True), bool):
        raise bad_value("log_processor.by_epoch", cfg["by_epoch"], "True or False")
    window = cfg.get("window_size", LOG_WINDOW)
    if not (is_int(window) and window >= 1):
        raise bad_value("log_processor.window_size", window, "an int >= 1")
    return window


def build_custom_hooks(cfgs: Sequence[Any] | None) -> list[TrainrunHook]:
    """MMEngine's ``custom_hooks``: hook objects or config dicts for ``HOOKS``, each given to
    trainrun's Runner inside ``HookAdapter`` (a trainrun hook as it is)."""
    built = []
    for i, cfg in enumerate(cfgs or ()):
        if isinstance(cfg, Mapping) and type_name(cfg.get("type")) in COMPAT_HOOKS:
            options = {k: v for k, v in cfg.items() if k != "type"}
            hook = COMPAT_HOOKS[type_name(cfg["type"])](**options)
        else:
            hook = HOOKS.build(cfg) if isinstance(cfg, Mapping) else cfg
        if hook is None:
            raise ConfigError(f"custom_hooks[{i}]: built nothing")
        built.append(hook if isinstance(hook, TrainrunHook) else HookAdapter(hook))
    return built


# ---------------------------------------------------------------- the runner


def evaluator_metrics(key: str, cfg: Any, loader: DataLoader | None) -> list[Any] | None:
    """The metrics of MMEngine's ``val_evaluator``/``test_evaluator``, each given the data
    set's ``metainfo`` as its ``dataset_meta`` (as MMEngine's loops give it)."""
    if cfg is None:
        return None
    if isinstance(cfg, Mapping) and type_name(cfg.get("type")) == "Evaluator":
        cfg = cfg.get("metrics")
    try:
        evaluator = cfg if isinstance(cfg, Evaluator) else Evaluator(cfg)
    except (KeyError, TypeError) as error:
        raise ConfigError(f"{key}: {error}") from None
    meta = getattr(getattr(loader, "dataset", None), "metainfo", None)
    if meta is not None:
        evaluator.dataset_meta = meta
    return evaluator.metrics


def loop_section(train_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """trainrun's ``schedule`` from MMEngine's ``train_cfg``."""
    cfg = dict(train_cfg or {})
    by_epoch = cfg.pop("by_epoch", None)
    kind = cfg.pop("type", None)
    if kind is not None:
        if type_name(kind) not in LOOPS:
            raise refused("train_cfg.type", type_name(kind), f"use {' or '.join(LOOPS)}")
        by_epoch = LOOPS[type_name(kind)]
    by_epoch = True if by_epoch is None else by_epoch
    only("train_cfg", cfg, {"max_epochs", "val_interval", "val_begin"} if by_epoch
         else {"max_iters", "val_interval", "val_begin"})
    length = "max_epochs" if by_epoch else "max_iters"
    if length not in cfg:
        raise ConfigError(f"train_cfg.{length}: missing")
    # MMEngine's defaults: every epoch for an epoch-based loop, every 1000 iterations else
    return {length: cfg[length], "val_interval": cfg.get("val_interval", 1 if by_epoch else 1000),
            "val_begin": cfg.get("val_begin", 1)}


def checked_loop_cfg(key: str, cfg: Any) -> None:
    """``val_cfg``/``test_cfg``: empty, or MMEngine's plain loop by type."""
    cfg = dict(cfg or {})
    kind = type_name(cfg.pop("type", "ValLoop" if key == "val_cfg" else "TestLoop"))
    if kind not in ("ValLoop", "TestLoop"):
        raise refused(f"{key}.type", kind, "use ValLoop or TestLoop")
    only(key, cfg, set())


# the env_cfg keys MMEngine's setup_env reads; it passes over any other without a word
ENV_CFG_KEYS = ("cudnn_benchmark", "mp_cfg", "dist_cfg", "resource_limit")
RESOURCE_LIMIT = 4096  # MMEngine's default soft limit of open files (env_cfg.resource_limit)


def ignored_env_keys(env_cfg: Mapping[str, Any] | None) -> list[str]:
    """A warning for each key of ``env_cfg`` that MMEngine's ``setup_env`` does not read (it
    ignores them; so does trainrun, saying so)."""
    lines = []
    for name, value in (env_cfg or {}).items():
        if name in ENV_CFG_KEYS:
            continue
        hint = "; a backend goes in env_cfg.dist_cfg.backend" if name == "backend" else ""
        lines.append(f"env_cfg.{name}={value!r} is ignored, as MMEngine ignores it (it reads "
                     f"{', '.join(ENV_CFG_KEYS)}){hint}")
    return lines


def raise_open_files_limit(limit: int) -> None:
    """Raise the soft limit of open files to ``limit`` (never above the hard limit, never
    lowering it), as MMEngine's ``setup_env`` does with ``env_cfg.resource_limit``."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(limit, soft)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def join(launcher: str, env_cfg: Mapping[str, Any] | None) -> bool:
    """Join the job's process group as MMEngine's ``setup_env`` does (with env_cfg's
    backend; trainrun's 'auto' when none is given), unless one is up; whether it joined.
    Keys MMEngine does not read are left to `ignored_env_keys`."""
    env_cfg = dict(env_cfg or {})
    if env_cfg.get("cudnn_benchmark"):
        torch.backends.cudnn.benchmark = True
    if sys.platform != "win32":
        raise_open_files_limit(env_cfg.get("resource_limit", RESOURCE_LIMIT))
    mp_cfg = dict(env_cfg.get("mp_cfg") or {})
    only("env_cfg.mp_cfg", mp_cfg, {"mp_start_method", "opencv_num_threads"})
    if "mp_start_method" in mp_cfg:
        torch.multiprocessing.set_start_method(mp_cfg["mp_start_method"], force=True)
    if "opencv_num_threads" in mp_cfg:
        try:
            import cv2
        except ImportError:
            pass  # OpenCV's threads matter only to code that imports it
        else:
            cv2.setNumThreads(mp_cfg["opencv_num_threads"])
    dist_cfg = dict(env_cfg.get("dist_cfg") or {})
    only("env_cfg.dist_cfg", dist_cfg, {"backend", "timeout"})
    if launcher == "none" or is_distributed():
        return False
    init_dist(launcher, dist_cfg.get("backend", "auto"), timeout=dist_cfg.get("timeout"))
    return True


def strategy_of(section: Mapping[str, Any]) -> Any:
    """The strategy trainrun's Runner gets for a translated ``strategy`` section: for ddp,
    ``MMEngineDDP``, whose checkpoints MMEngine's ``load_checkpoint`` reads too."""
    options = {k: v for k, v in section.items() if k != "type"}
    return MMEngineDDP(**options) if section["type"] == "ddp" else dict(section)


def with_wrapper_options(strategy: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    """``strategy`` with the DDP options MMEngine's Runner reads from its config:
    ``model_wrapper_cfg`` (MMDistributedDataParallel's options) and
    ``find_unused_parameters``."""
    out = dict(strategy)
    if not isinstance(cfg, Mapping):
        return out
    wrapper = dict(cfg.get("model_wrapper_cfg") or {})
    if "find_unused_parameters" in cfg:
        wrapper.setdefault("find_unused_parameters", cfg["find_unused_parameters"])
    if not wrapper:
        return out
    if out["type"] != "ddp":
        raise refused("model_wrapper_cfg", cfg.get("model_wrapper_cfg"),
                      "give the strategy's options in strategy")
    kind = type_name(wrapper.pop("type", "MMDistributedDataParallel"))
    if kind != "MMDistributedDataParallel":
        raise refused("model_wrapper_cfg.type", kind, "use MMDistributedDataParallel")
    wrapper.pop("device_ids", None)  # trainrun gives each rank its own device
    only("model_wrapper_cfg", wrapper, DDP_WRAPPER_KEYS)
    return {**out, **wrapper}


def start_from(run_dir: MMEngineRunDir, resume: Any, load_from: str | None) -> bool | str:
    """trainrun's ``resume`` for MMEngine's ``resume`` and ``load_from``: with both, resume
    from ``load_from``; ``resume=True`` alone, from the newest checkpoint of the work directory
    (trainrun's ``last``, else MMEngine's ``last_checkpoint`` in a directory MMEngine wrote)."""
    if isinstance(resume, (str, os.PathLike)):  # MMEngine also takes the path itself
        return str(resume)
    if resume and load_from:
        return str(load_from)
    if resume and not (run_dir.checkpoints / LAST).is_file() \
            and run_dir.last_checkpoint.is_file():
        return run_dir.last_checkpoint.read_text(encoding="utf-8").strip()
    return bool(resume)


def check_arguments(given: Mapping[str, Any]) -> None:
    """Refuse, before anything starts, MMEngine Runner arguments trainrun cannot honour:
    ``given``, MMEngine's Runner arguments by name.

    Raises:
        ConfigError: naming the argument.
    """
    for key, value, neutral in (("auto_scale_lr", given["auto_scale_lr"], (None,)),
                                ("visualizer", given["visualizer"], (None,)),
                                ("experiment_name", given["experiment_name"], (None,)),
                                ("log_level", given["log_level"], ("INFO",)),
                                ("default_scope", given["default_scope"], (None, "mmengine"))):
        if value not in neutral:
            raise refused(key, value)
    for split, loader, loop, evaluator in (
            ("val", given["val_dataloader"], given["val_cfg"], given["val_evaluator"]),
            ("test", given["test_dataloader"], given["test_cfg"], given["test_evaluator"])):
        present = [x is not None for x in (loader, loop, evaluator)]
        if any(present) and not all(present):
            raise ConfigError(f"{split}_dataloader, {split}_cfg and {split}_evaluator: give "
                              f"all three or none (as MMEngine requires)")
        if loop is not None:
            checked_loop_cfg(f"{split}_cfg", loop)
    log_window(given["log_processor"])
    only("randomness", dict(given["randomness"] or {}), {"seed", "deterministic", "diff_rank_seed"})


def runner_arguments(strategy: Mapping[str, Any], precision: str | None,
                     given: Mapping[str, Any]) -> tuple[dict[str, Any], SyncedSeeds | None]:
    """trainrun Runner's keyword arguments for MMEngine's Runner arguments ``given`` (checked by
    `check_arguments`), with ``strategy`` (trainrun's section) and ``precision`` (None: the
    optimiser wrapper's); and the sampler seeds to replay after the seeding (None without
    ``diff_rank_seed``). The data sets and loaders are built; nothing is started or written.

    Raises:
        ConfigError: an option with no trainrun equivalent (named).
    """
    model, train_dataloader = given["model"], given["train_dataloader"]
    randomness = dict(given["randomness"] or {})
    strategy = with_wrapper_options(strategy, given["cfg"])
    seed = randomness.get("seed")
    randomness["seed"] = seed = sync_random_seed() if seed is None else seed
    # diff_rank_seed: each rank seeds with seed + rank; samplers share MMEngine's draws
    synced = SyncedSeeds(seed) if randomness.get("diff_rank_seed") else None
    own = seed + get_dist_info()[0] if synced else seed
    if isinstance(model, Mapping):
        model = dict(model)
        if given["data_preprocessor"] is not None:
            model.setdefault("data_preprocessor", given["data_preprocessor"])
    schedule = loop_section(given["train_cfg"]) if train_dataloader is not None else None
    by_epoch = schedule is None or "max_epochs" in schedule
    train_loader = build_loader("train_dataloader", train_dataloader, own,
                                schedule.get("max_iters") if schedule else None,
                                synced)
    optim, wrapper_precision = optim_section(given["optim_wrapper"])
    if strategy["type"] == "deepspeed" and "clip_value" in ((optim or {}).get("clip_grad") or {}):
        raise refused("optim_wrapper.clip_grad.type", "value",
                      "DeepSpeedStrategy clips the total norm only (its gradient_clipping)")
    scheduler = None
    if train_loader is not None and given["param_scheduler"] is not None:
        scheduler = scheduler_factory(given["param_scheduler"],
                                      len(train_loader) if by_epoch else None,
                                      schedule.get("max_epochs"))
    checkpoint, logging = hook_sections(given["default_hooks"], by_epoch)
    logging["window"] = log_window(given["log_processor"])
    run_dir = MMEngineRunDir(given["work_dir"])
    val_loader = build_loader("val_dataloader", given["val_dataloader"], own, None, synced)
    test_loader = build_loader("test_dataloader", given["test_dataloader"], own, None, synced)
    for key, loader in (("train_dataloader", train_loader), ("val_dataloader", val_loader),
                        ("test_dataloader", test_loader)):
        check_shares(key, loader, strategy["type"])
    val_metrics = evaluator_metrics("val_evaluator", given["val_evaluator"], val_loader)
    test_metrics = evaluator_metrics("test_evaluator", given["test_evaluator"], test_loader)
    return dict(
        model=model, work_dir=run_dir, train_dataloader=train_loader,
        val_dataloader=val_loader, test_dataloader=test_loader,
        optim=optim, scheduler=scheduler, strategy=strategy_of(strategy),
        precision=precision or wrapper_precision, schedule=schedule,
        val_metrics=val_metrics, test_metrics=test_metrics,
        hooks=[*build_custom_hooks(given["custom_hooks"]), LastCheckpointFile(run_dir)],
        randomness=randomness, logging=logging, checkpoint=checkpoint,
        resume=start_from(run_dir, given["resume"], given["load_from"]),
        load_from=None if given["resume"] else given["load_from"], launcher="none"), synced


class Runner(TrainrunRunner):
    """MMEngine's Runner: its constructor arguments, translated into trainrun's Runner.

    The arguments are MMEngine's (see its documentation); the ones trainrun supports, and how
    they map, are in docs/mmengine.md. The model is wrapped as MMEngine's Runner wraps it: in
    DDP without broadcasting buffers. ``train()``, ``val()`` and ``test()`` are trainrun's.

    Raises:
        ConfigError: an argument or option with no trainrun equivalent (named), or what
            trainrun's Runner refuses.
    """

    def __init__(self, model: nn.Module | Mapping[str, Any], work_dir: str,
                 train_dataloader: Any = None, val_dataloader: Any = None,
                 test_dataloader: Any = None, train_cfg: Mapping[str, Any] | None = None,
                 val_cfg: Mapping[str, Any] | None = None,
                 test_cfg: Mapping[str, Any] | None = None,
                 auto_scale_lr: Mapping[str, Any] | None = None, optim_wrapper: Any = None,
                 param_scheduler: Any = None, val_evaluator: Any = None,
                 test_evaluator: Any = None, default_hooks: Mapping[str, Any] | None = None,
                 custom_hooks: Sequence[Any] | None = None, data_preprocessor: Any = None,
                 load_from: str | None = None, resume: bool = False, launcher: str = "none",
                 env_cfg: Mapping[str, Any] | None = None, log_processor: Any = None,
                 log_level: str = "INFO", visualizer: Any = None,
                 default_scope: str | None = "mmengine",
                 randomness: Mapping[str, Any] | None = None, experiment_name: str | None = None,
                 cfg: Any = None) -> None:
        arguments = dict(locals())  # MMEngine's arguments, by name
        del arguments["self"]
        self._start({"type": "ddp", "broadcast_buffers": False}, None, **arguments)

    def _start(self, strategy: Mapping[str, Any], precision: str | None,
               **arguments: Any) -> None:
        """Check and translate MMEngine's ``arguments`` (by name), join the process group
        and build trainrun's Runner with ``strategy`` (its section) and ``precision`` (None:
        the optimiser wrapper's). From here on, a refusal a script (not an interactive
        prompt) does not catch exits 2 in one line (``exit_2_on_refusal``)."""
        if not (hasattr(sys, "ps1") or sys.flags.interactive):  # a script, not a prompt
            sys.excepthook = exit_2_on_refusal
        check_arguments(arguments)
        self._trains = arguments["train_dataloader"] is not None  # MMEngine inits to train
        joined = join(arguments["launcher"], arguments["env_cfg"])
        try:
            runner_kwargs, synced = runner_arguments(strategy, precision, arguments)
            super().__init__(**runner_kwargs)
            if self.rank == 0:  # every rank finds them alike
                for line in ignored_env_keys(arguments["env_cfg"]):
                    self.logger.warning(line)
            if synced:  # after the seeding, numpy's generator as MMEngine's loaders left it
                synced.replay()
        except BaseException:
            if joined:
                from trainrun.dist import leave_dist

                leave_dist()
            raise
        self._owns_group = joined  # trainrun's close() leaves the group this runner joined
        self.mmengine_cfg = arguments["cfg"]

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """MMEngine's weight initialisation, for a runner that trains: the model's
        ``init_weights()`` where it has one, after the seeding (MMEngine calls it at the
        start of ``train()``, with the same draws from the seeded generators), then rank 0's
        weights and buffers on every rank, as MMEngine broadcasts them."""
        init = getattr(model, "init_weights", None)
        if self._trains and callable(init):
            init()
            if is_distributed():
                for tensor in model.state_dict().values():
                    broadcast(tensor, 0)
        return model

    def resume(self, path: str | os.PathLike) -> None:
        """trainrun's resume; from MMEngine's own file in an iteration-based run, the data
        goes on where MMEngine's would (``continue_as_mmengine``)."""
        super().resume(path)
        continue_as_mmengine(self, path)

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> Runner:  # type: ignore[override]
        """A runner from an MMEngine config (a ``Config`` or a dict): its keys that are the
        constructor's arguments, with the whole config as ``cfg``. Its other keys are the
        config's own variables (``data_root``, ``train_pipeline``, ...), as MMEngine takes
        them; the two MMEngine's Runner reads from the config, ``model_wrapper_cfg`` and
        ``find_unused_parameters``, are read the same way."""
        import inspect

        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "cfg"}
        return cls(**{key: cfg[key] for key in cfg if key in accepted}, cfg=cfg)


# MMEngine's FSDP sharding strategies by their names, and trainrun's
SHARDING = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad_op", "NO_SHARD": "none",
            "HYBRID_SHARD": "hybrid"}
DDP_WRAPPER_KEYS = {"find_unused_parameters", "broadcast_buffers", "bucket_cap_mb",
                    "gradient_as_bucket_view", "static_graph", "detect_anomalous_params"}


def wrap_option(policy: Any) -> dict[str, Any]:
    """trainrun's ``strategy.wrap`` for an FSDP ``auto_wrap_policy``: torch's size-based policy
    (its ``min_num_params``) or transformer policy (its layer classes, by name), as a partial
    or as MMEngine's ``dict(type=..., ...)``."""
    if isinstance(policy, Mapping):
        options = dict(policy)
        name = type_name(options.pop("type", None)).rpartition(".")[2]
    elif isinstance(policy, partial):
        name, options = policy.func.__name__, dict(policy.keywords)
    else:
        raise refused("strategy.model_wrapper.auto_wrap_policy", policy,
                      "give size_based_auto_wrap_policy or transformer_auto_wrap_policy "
                      "with its options (a partial or a dict)")
    if name == "size_based_auto_wrap_policy" and set(options) == {"min_num_params"}:
        return {"min_params": int(options["min_num_params"])}
    if name == "transformer_auto_wrap_policy" and set(options) == {"transformer_layer_cls"}:
        return {"classes": [type_name(c) for c in options["transformer_layer_cls"]]}
    raise refused("strategy.model_wrapper.auto_wrap_policy", policy,
                  "give size_based_auto_wrap_policy(min_num_params=...) or "
                  "transformer_auto_wrap_policy(transformer_layer_cls=...)")


def strategy_section(cfg: Any) -> tuple[dict[str, Any], str | None]:
    """trainrun's ``strategy`` section, and the precision it sets (None: the optimiser
    wrapper's), for FlexibleRunner's ``strategy``: DDPStrategy, FSDPStrategy or
    DeepSpeedStrategy."""
    if cfg is None:
        return {"type": "ddp"}, None
    if not isinstance(cfg, Mapping):
        raise refused("strategy", cfg, "give a dict")
    cfg = dict(cfg)
    kind = type_name(cfg.pop("type", None))
    if kind in ("DDPStrategy", "FSDPStrategy"):
        wrapper = dict(cfg.pop("model_wrapper", None) or {})
        wrapper.pop("type", None)
        only("strategy", cfg, set())
        if kind == "DDPStrategy":
            only("strategy.model_wrapper", wrapper, DDP_WRAPPER_KEYS)
            return {"type": "ddp", **wrapper}, None
        only("strategy.model_wrapper", wrapper,
             {"auto_wrap_policy", "sharding_strategy", "cpu_offload"})
        out: dict[str, Any] = {"type": "fsdp"}
        if wrapper.get("auto_wrap_policy") is not None:
            out["wrap"] = wrap_option(wrapper["auto_wrap_policy"])
        sharding = wrapper.get("sharding_strategy")
        if sharding is not None:
            name = getattr(sharding, "name", sharding)
            if name not in SHARDING:
                raise refused("strategy.model_wrapper.sharding_strategy", sharding,
                              f"use one of {', '.join(SHARDING)}")
            out["sharding"] = SHARDING[name]
        if wrapper.get("cpu_offload") is not None:
            offload = wrapper["cpu_offload"]
            out["cpu_offload"] = bool(getattr(offload, "offload_params", offload))
        return out, None
    if kind == "DeepSpeedStrategy":
        only("strategy", cfg, {"zero_optimization", "fp16", "bf16", "gradient_clipping",
                               "steps_per_print", "inputs_to_half"})
        # MMEngine casts the inputs named here to half for DeepSpeed's fp16/bf16 engine;
        # trainrun's engine wrapper casts every floating-point input (integer labels stay)
        cfg.pop("inputs_to_half", None)
        zero = dict(cfg.pop("zero_optimization", None) or {})
        stage = zero.pop("stage", 0)
        precision = None
        for name, value in (("fp16", "fp16"), ("bf16", "bf16")):
            section = dict(cfg.pop(name, None) or {})
            if section.pop("enabled", False):
                precision = value
            if section:
                cfg.setdefault("config", {})[name] = section
        raw = {**cfg.pop("config", {}), **cfg}
        if zero:
            raw["zero_optimization"] = zero
        if precision:
            # the DeepSpeed that MMEngine knew cast buffers (BatchNorm's running statistics)
            # with the weights; DeepSpeed 0.19.8 keeps them in fp32 unless told, and cuDNN's
            # batch norm then fails in backward
            raw["data_types"] = {"buffer_dtype": precision}
        return {"type": "deepspeed", "zero_stage": stage, **({"config": raw} if raw else {})}, \
            precision
    raise refused("strategy.type", kind, "use DDPStrategy, FSDPStrategy or DeepSpeedStrategy")


class FlexibleRunner(Runner):
    """MMEngine's FlexibleRunner: the Runner's arguments (keyword-only after ``model``) and
    ``strategy``, ``dict(type='DDPStrategy' | 'FSDPStrategy' | 'DeepSpeedStrategy', ...)``,
    which becomes trainrun's ddp, fsdp or deepspeed strategy. ``launcher`` None finds the
    launcher from the environment (torchrun's variables: ``'pytorch'``).

    Raises:
        ConfigError: an argument or option with no trainrun equivalent (named).
    """

    def __init__(self, model: nn.Module | Mapping[str, Any], *, work_dir: str = "work_dirs",
                 experiment_name: str | None = None, train_dataloader: Any = None,
                 optim_wrapper: Any = None, param_scheduler: Any = None,
                 train_cfg: Mapping[str, Any] | None = None, val_dataloader: Any = None,
                 val_evaluator: Any = None, val_cfg: Mapping[str, Any] | None = None,
                 test_dataloader: Any = None, test_evaluator: Any = None,
                 test_cfg: Mapping[str, Any] | None = None, strategy: Any = None,
                 auto_scale_lr: Mapping[str, Any] | None = None,
                 default_hooks: Mapping[str, Any] | None = None,
                 custom_hooks: Sequence[Any] | None = None, data_preprocessor: Any = None,
                 load_from: str | None = None, resume: bool = False,
                 launcher: str | None = None, env_cfg: Mapping[str, Any] | None = None,
                 log_processor: Any = None, log_level: str = "INFO", visualizer: Any = None,
                 default_scope: str | None = "mmengine",
                 randomness: Mapping[str, Any] | None = None, compile: Any = False,
                 cfg: Any = None) -> None:
        arguments = dict(locals())  # MMEngine's arguments, by name
        for name in ("self", "strategy", "compile"):
            del arguments[name]
        if compile:
            raise refused("compile", compile, "set trainrun's compile in a trainrun config")
        if launcher is None:
            arguments["launcher"] = infer_launcher()
        self._start(*strategy_section(strategy), **arguments)


RUNNERS.register_module(module=Runner)
RUNNERS.register_module(module=FlexibleRunner)

__all__ = ["FlexibleRunner", "Runner", "load_checkpoint"]
