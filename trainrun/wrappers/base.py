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
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from trainrun.checkpoint.optimizer_state import Optimizers
from trainrun.messages import first_line
from trainrun.wrappers.checkpointing import Checkpointing
from trainrun.wrappers.sharding import Sharding

log = logging.getLogger("trainrun")

# What `setup` returns as the optimiser (``Optimizers``): one, or one per named submodule.
MakeOptimizer = Callable[[nn.Module], Optimizers]


class Strategy(Checkpointing, Sharding, ABC):
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
    ``full_params`` and ``shard_params``. The defaults of the checkpoint methods are
    ``Checkpointing``'s (trainrun/wrappers/checkpointing.py), those of the sharding and memory
    methods ``Sharding``'s (trainrun/wrappers/sharding.py): both are bases of ``Strategy``.

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
        model_parallel_size: how many consecutive ranks hold one copy of the model between
            them (tensor-parallel peers): they see the same batches, so the data is dealt to
            the world size divided by it; 1 for strategies where every rank has its own.
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
    COMPILES: ClassVar[str | None] = None
    compile_options: dict[str, Any] | None = None
    model_parallel_size: int = 1

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ValueError(
                f"strategy {self.name!r} takes no option {unknown[0]!r}; "
                f"its options are: {', '.join(sorted(self.OPTIONS)) or 'none'}"
            )
        self.options = {**self.OPTIONS, **options}

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
        self._end_background_writes()


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
