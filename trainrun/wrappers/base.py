"""The interface every strategy implements, so the runner never cares which one it holds.

A strategy takes the plain model, returns it wrapped for its kind of parallelism with its
optimiser built over the right parameters, and knows how that pair is checkpointed; reading its
checkpoints is its format's part (``Strategy.FORMAT``, a format of ``trainrun.checkpoint``).
Adding a strategy is one new file with a subclass of ``Strategy`` and one
``STRATEGIES.register`` line (``trainrun.registry``; trainrun/wrappers/__init__.py registers
the shipped ones).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from trainrun.checkpoint.files import BackgroundWriter, files_written_by, save_state_file
from trainrun.checkpoint.format import load_state_file
from trainrun.dist import barrier, is_main_process
from trainrun.messages import first_line
from trainrun.wrappers.memory import ParamSpec, StateBytes, optimizer_tensors, replicated

log = logging.getLogger("trainrun")

# What `setup` returns as the optimiser: one, or one per named submodule.
Optimizers = Optimizer | dict[str, Optimizer]
MakeOptimizer = Callable[[nn.Module], Optimizers]


def optimizer_state(optimizer: Optimizers | None) -> Any:
    if optimizer is None:
        return None
    if isinstance(optimizer, Mapping):
        return {name: opt.state_dict() for name, opt in optimizer.items()}
    return optimizer.state_dict()


class OptimizerMismatch(ValueError):
    """A checkpoint's optimiser state that this run's optimiser cannot take."""


OPTIMIZER_MISMATCH_HINT = ("optim.paramwise or optim.type changed since it was written; its "
                           "weights alone can start a run (load_from)")


def load_optimizer_state(optimizer: Optimizers | None, state: Any) -> None:
    """Load ``state`` into ``optimizer``; one that does not fit (other parameter groups, or
    another optimiser) is an `OptimizerMismatch` saying so."""
    if optimizer is None or state is None:
        return
    try:
        if isinstance(optimizer, Mapping):
            for name, opt in optimizer.items():
                opt.load_state_dict(state[name])
        else:
            optimizer.load_state_dict(state)
    except (ValueError, KeyError) as error:
        raise OptimizerMismatch(f"its optimiser state does not fit this run's optimiser "
                                f"({first_line(error)}): {OPTIMIZER_MISMATCH_HINT}") from None


class Strategy(ABC):
    """How a model is wrapped, stepped and checkpointed for one kind of parallelism.

    A new strategy implements ``name`` and ``setup`` (which returns a model meeting
    ``trainrun.wrappers.contracts.ModelContract``), and declares ``OPTIONS`` and ``WRAPPERS``.
    It may inherit the rest, overriding where it differs: ``unwrap``, ``model_state_dict`` and
    ``load_model_state_dict``; ``save_checkpoint``, ``save_checkpoint_async`` and
    ``load_checkpoint`` (one torch file from rank 0) with ``WRITER_RANK``; ``optim_wrapper``
    (for an engine that steps its own optimiser); ``configure``, ``check_config`` and
    ``teardown``. Checkpoints written in a format of their own (a directory) name it in
    ``FORMAT``: a ``trainrun.checkpoint.CheckpointFormat`` registered in ``FORMATS``, which
    reads them (the runner, the checkpoint manager, export and test find it through
    ``trainrun.checkpoint.checkpoint_format``, and never ask a strategy). A strategy that
    shards or offloads overrides ``memory_plan`` (what ``--dry-run`` plans per rank) and, where
    it holds state outside the module and optimiser, ``state_tensors``; one that keeps only a
    part of each parameter on a rank overrides ``param_shards``, ``shards_written``,
    ``full_params`` and ``shard_params``.

    The runner calls, in order: ``use_compile`` and ``configure``, then ``setup`` and
    ``optim_wrapper``; ``load_checkpoint`` or ``load_model_state_dict`` to start from a
    checkpoint; ``save_checkpoint`` (or ``save_checkpoint_async``) through its checkpoint
    manager; ``teardown`` when it closes. The config layer calls ``check_config`` before
    anything starts.

    Attributes:
        name: the strategy's name, as ``strategy.type`` gives it.
        OPTIONS: the options this strategy takes under ``strategy:`` in the config, with
            their defaults.
        ACCEPTS: what each option accepts, in words, for the config reference (each option's
            meaning is the class docstring's ``Args:`` entry).
        WRAPPERS: the classes of the model ``setup`` returns (what ``is_model_wrapper``
            recognises): a class, or a class's name where importing its library only to ask
            would cost every run start-up time.
        WRITER_RANK: in a checkpoint of this strategy, a pattern matching the names of the
            files each rank writes itself (group 1 is the writer's rank); files it does not
            match (all, if None) are rank 0's.
        FORMAT: the name (in ``trainrun.registry.FORMATS``) of the checkpoint format this
            strategy writes; ``'torch_file'``: one torch file.
        COMPILES: what ``setup`` compiles when the config's ``compile`` is on, in words for
            the plan; None: this strategy does not compile (the config refuses ``compile``
            for it).
        compile_options: the ``compile`` options (``COMPILE_DEFAULTS``' keys) ``use_compile``
            gave; None: no compiling.
        options: the options given, over ``OPTIONS``' defaults.

    Args:
        **options: this strategy's options (the keys of ``OPTIONS``); those not given keep
            their defaults.

    Raises:
        ValueError: an option this strategy does not take (the message lists those it does).
    """

    name: ClassVar[str]
    OPTIONS: ClassVar[dict[str, Any]] = {}
    ACCEPTS: ClassVar[dict[str, str]] = {}
    WRAPPERS: ClassVar[tuple[type | str, ...]] = ()
    WRITER_RANK: ClassVar[re.Pattern[str] | None] = None
    FORMAT: ClassVar[str] = "torch_file"
    COMPILES: ClassVar[str | None] = None
    compile_options: dict[str, Any] | None = None

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ValueError(
                f"strategy {self.name!r} takes no option {unknown[0]!r}; "
                f"its options are: {', '.join(sorted(self.OPTIONS)) or 'none'}"
            )
        self.options = {**self.OPTIONS, **options}
        self._background = BackgroundWriter()  # checkpoint files written in the background

    def configure(self, batch_size: int | None, optim: Mapping[str, Any],  # noqa: B027
                  precision: str) -> None:
        """The run's own settings, before ``setup``: per-rank batch size, the ``optim`` section
        and the precision. Strategies that step the optimiser themselves (DeepSpeed) need them;
        this default ignores them.

        Args:
            batch_size: the training loader's batch size on each rank (None without training
                data).
            optim: the ``optim`` section (empty when the optimiser is built by a function).
            precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``.
        """

    def use_compile(self, options: Mapping[str, Any] | None) -> None:
        """Have ``setup`` compile the model with ``options`` (``COMPILE_DEFAULTS``' keys), where
        the strategy says (``COMPILES``); None: no compiling.

        Args:
            options: torch.compile's options (backend, mode, fullgraph, dynamic; those not
                given keep their defaults), or None.

        Raises:
            ValueError: options given to a strategy that does not compile.
        """
        if options is not None and self.COMPILES is None:
            raise ValueError(f"compile: strategy {self.name!r} does not compile models")
        self.compile_options = None if options is None else {**COMPILE_DEFAULTS, **options}

    @classmethod  # noqa: B027 - optional: most strategies run any checked config
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        """Refuse (ValueError) a checked, plain run config this strategy cannot run, before
        anything starts; the config layer reports it as a config error. Default: all fine.

        Args:
            cfg: the whole run config, checked, as plain dicts and lists.

        Raises:
            ValueError: a setting this strategy cannot run, in one line naming the key.
        """

    @classmethod
    def options_in(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """This strategy's options as ``cfg['strategy']`` gives them, defaults filled in (other
        strategies' options left out).

        Args:
            cfg: the whole run config, as plain dicts.

        Returns:
            The options by name.
        """
        given = cfg["strategy"]
        return {**cls.OPTIONS, **{k: v for k, v in given.items() if k in cls.OPTIONS}}

    @abstractmethod
    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        """Move ``model`` to ``device``, wrap it, and build its optimiser with ``make_optimizer``
        over the parameters that will be trained (after wrapping, for strategies that shard).
        The model returned meets ``trainrun.wrappers.contracts.ModelContract``.

        Called on every rank, once the process group (if any) is up; it compiles the model
        first where ``use_compile`` asked for it.

        Args:
            model: the user's plain model.
            device: this rank's device.
            make_optimizer: builds the optimiser (or a dict of them by submodule) from a
                module; None: no optimiser (evaluation only).

        Returns:
            The wrapped model (with ``train_step``, ``val_step``, ``test_step`` and
            ``.module``) and the optimiser, or None.
        """

    def optim_wrapper(self, model: nn.Module, optimizer: Optimizers | None) -> Any:
        """The optimiser wrapper ``train_step`` gets (meeting ``contracts.StepOptimWrapper``),
        for a strategy whose wrapped model steps the optimiser itself; ``None`` (this default):
        the runner's own ``OptimWrapper``.

        Args:
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned.

        Returns:
            The strategy's own optimiser wrapper, or None.
        """
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside the wrapper.

        Args:
            model: the model ``setup`` returned (or a plain one).

        Returns:
            Its ``.module``, or ``model`` itself where it has none.
        """
        return getattr(model, "module", model)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state with the unwrapped model's keys.

        Args:
            model: the model ``setup`` returned.

        Returns:
            The state dict, as the plain model's ``state_dict()`` keys it.
        """
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a whole model's state (the plain model's keys) into the wrapped model.

        Called on every rank (``Runner.load_weights``, for ``load_from``).

        Args:
            model: the model ``setup`` returned.
            state: the weights, as ``model_state_dict`` gives them.
        """
        self.unwrap(model).load_state_dict(state)

    # ------------------------------------------------ this rank's share of the parameters
    # What a hook that keeps a copy of the weights beside the model (EMA) works on, so that
    # its copy is sharded as the model is. Strategies whose every rank holds the whole model
    # inherit these four; a sharded one overrides all of them.

    def param_shards(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's part of each parameter, by the plain model's names: tensors that share
        the parameters' storage, so that writing into them (then ``shards_written``) changes
        what the next forward computes with. This default: the whole parameters.

        Args:
            model: the model ``setup`` returned.

        Returns:
            This rank's part of every parameter, by name (detached).
        """
        return {name: param.detach() for name, param in self.unwrap(model).named_parameters()}

    def shards_written(self, model: nn.Module) -> None:  # noqa: B027 - optional
        """``param_shards``' tensors were written into: refresh any gathered copy of them the
        strategy keeps (every rank calls this).

        Args:
            model: the model ``setup`` returned.
        """

    def full_params(self, model: nn.Module,
                    shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors from every rank's ``shards`` (each cut as ``param_shards`` cuts the
        parameter of its name); a collective for a sharded strategy. This default: as given.

        Args:
            model: the model ``setup`` returned.
            shards: this rank's part of each tensor, by parameter name.

        Returns:
            The whole tensors, by name.
        """
        return dict(shards)

    def shard_params(self, model: nn.Module,
                     full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of each whole tensor in ``full``, cut as ``param_shards`` cuts the
        parameter of its name (every rank calls this). This default: as given.

        Args:
            model: the model ``setup`` returned.
            full: whole tensors, by parameter name.

        Returns:
            This rank's part of each, by name.
        """
        return dict(full)

    # ------------------------------------------------ memory: planned and held
    # What `--dry-run` plans before anything starts, and what a running job holds, by kind
    # (trainrun/wrappers/memory.py). This default is the replicated case: every rank holds
    # the whole model, its gradients and its optimiser state.

    @classmethod
    def memory_plan(cls, specs: Sequence[ParamSpec], world_size: int, cfg: Mapping[str, Any],
                    model: nn.Module | None = None) -> StateBytes:
        """The most bytes of parameters, gradients and optimiser state any of ``world_size``
        ranks will hold, from the parameters' ``specs`` and the checked, plain run config
        (``model``: the model built on the meta device, for strategies that need its
        structure). This default: the whole of each on every rank, in the model's dtype.

        Args:
            specs: each parameter's shape, dtype and whether it is trained.
            world_size: the number of ranks planned for.
            cfg: the checked, plain run config.
            model: the model built on the meta device, or None.

        Returns:
            The planned bytes by kind, with notes on what the total leaves out.
        """
        plan = replicated(specs)
        if cfg.get("precision", "fp32") != "fp32":
            plan.notes.append(f"precision {cfg['precision']}: autocast computes in it; the "
                              f"state stays in the model's dtype")
        return plan

    def state_tensors(self, model: nn.Module, optimizer: Optimizers | None
                      ) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds now, by kind ('params', 'grads', 'optim'): what
        ``memory.measure`` counts to check ``memory_plan`` against a running job. This default:
        the module's parameters, their gradients and the optimiser's state.

        Args:
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.

        Returns:
            The tensors by kind (entries may be None, e.g. a gradient not yet made).
        """
        params = list(self.unwrap(model).parameters())
        return {"params": params, "grads": [p.grad for p in params],
                "optim": optimizer_tensors(optimizer)}

    def measure_inside_step(self, take: Callable[[], None]) -> None:  # noqa: B027 - optional
        """Have ``take`` called wherever inside a training step this strategy's state peaks
        apart from around the optimiser's step (which ``memory.PeakWatch`` measures itself).
        This default: nowhere else.

        Args:
            take: records the memory held at the moment it is called.
        """

    def save_checkpoint(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                        extra: dict[str, Any]) -> None:
        """Write model, optimiser and ``extra`` to ``path``; called on every rank.

        This default writes one file from rank 0, which suits strategies whose every rank
        holds the whole model. Sharded strategies write a directory, every rank its part.

        Args:
            path: where to write (the checkpoint manager's temporary name; it publishes the
                checkpoint once every rank's part is on disk).
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.
            extra: the runner's own state (position, RNG states, schedulers, hooks' states).
        """
        if is_main_process():
            save_state_file(path, self._whole_state(model, optimizer, extra))
        barrier()

    def own_files(self, path: str | os.PathLike, rank: int) -> list[Path]:
        """The files of the checkpoint at ``path`` (a file, or a directory) that ``rank`` wrote:
        the ones it can fsync and hash from its own page cache (another rank's may be on
        another node).

        Args:
            path: the checkpoint.
            rank: the writer's rank.

        Returns:
            The files ``WRITER_RANK`` gives to ``rank`` (all of them to rank 0 where it is
            None).
        """
        return files_written_by(Path(path), rank, self.WRITER_RANK)

    def save_checkpoint_async(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                              extra: dict[str, Any]) -> Future:
        """``save_checkpoint`` that returns once the state is copied in memory: the write goes
        on in a background thread, and the future ends when this rank's part is on disk.
        Called on every rank; training may change the model as soon as this returns.

        Args:
            path: where to write, as for ``save_checkpoint``.
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.
            extra: the runner's own state.

        Returns:
            A future that ends (or raises) when this rank's part is written.
        """
        return self._background.save(path, self._whole_state(model, optimizer, extra)
                                     if is_main_process() else None)

    def _whole_state(self, model: nn.Module, optimizer: Optimizers | None,
                     extra: dict[str, Any]) -> dict[str, Any]:
        """What a one-file checkpoint holds: model, optimiser and the runner's ``extra``."""
        return {"model": self.model_state_dict(model), "optimizer": optimizer_state(optimizer),
                **extra}

    def load_checkpoint(self, path: str, model: nn.Module,
                        optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore model and optimiser from ``path`` on every rank; returns the extra state.

        Args:
            path: the checkpoint (in this strategy's format).
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.

        Returns:
            The ``extra`` state ``save_checkpoint`` was given.

        Raises:
            OptimizerMismatch: the saved optimiser state does not fit this run's optimiser.
            ValueError: the file is not a readable checkpoint, or is truncated.
        """
        state = load_state_file(path)
        self.load_model_state_dict(model, state.pop("model"))
        load_optimizer_state(optimizer, state.pop("optimizer", None))
        return state

    @classmethod
    def wraps(cls, model: Any) -> bool:
        """Whether ``model`` is of one of this strategy's ``WRAPPERS``; what
        ``trainrun.wrappers.is_model_wrapper`` asks every registered strategy.

        Args:
            model: any object.

        Returns:
            True where its class (or a base) is one of ``WRAPPERS``.
        """
        names = {c.__name__ for c in type(model).__mro__}
        return any(wrapper in names if isinstance(wrapper, str) else isinstance(model, wrapper)
                   for wrapper in cls.WRAPPERS)

    def teardown(self) -> None:
        """Release what the strategy holds before the process group goes away.

        Called by the runner's ``close``, on every rank; this default waits for background
        checkpoint writes to end.
        """
        self._background.close()


# ---------------------------------------------------------------- torch.compile

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# inductor generates code; aot_eager traces forward and backward but runs them eagerly, and
# eager only captures the graph: the two are quick checks that a model compiles at all.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_DEFAULTS: dict[str, Any] = {"backend": "inductor", "mode": "default",
                                    "fullgraph": False, "dynamic": None}


class CompileFailed(RuntimeError):
    """torch.compile failed on a module; the message names it."""


def compile_module(module: nn.Module, name: str, options: Mapping[str, Any]) -> None:
    """Compile ``module``'s forward in place, so that its hooks (a strategy's) stay outside
    the compiled code and its state dict keeps its keys (no ``_orig_mod.``). ``name`` is its
    dotted place in the model ('model', 'model.blocks.0'), which a failure names.

    Compiling happens at the first call (and again where guards fail: eval mode, another
    batch shape). Under inductor, random operations (dropout) draw as in eager mode, from the
    same generator: losses stay those of the uncompiled run, and resume stays exact.
    """
    options = {**COMPILE_DEFAULTS, **options}
    backend = options["backend"]
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    from torch._dynamo.exc import TorchDynamoException

    compiled = torch.compile(module.forward, backend=backend, fullgraph=options["fullgraph"],
                             dynamic=options["dynamic"],
                             mode=options["mode"] if backend == "inductor" else None)
    what = f"{'fullgraph ' if options['fullgraph'] else ''}compile of " \
           f"{type(module).__name__} ({name})"

    @functools.wraps(module.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except TorchDynamoException as error:
            raise CompileFailed(f"compile: {what} failed: {first_line(error)}") from error

    module.forward = forward
    shown = ", ".join(f"{key}={value}" for key, value in options.items())
    log.info("compile: %s (%s) is compiled at its first call (%s)", name,
             type(module).__name__, shown)
