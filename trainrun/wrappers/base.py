"""The interface every strategy implements, so the runner never cares which one it holds, and
the registry of strategies.

A strategy takes the plain model, returns it wrapped for its kind of parallelism with its
optimiser built over the right parameters, and knows how that pair is checkpointed and how its
checkpoints are read. Adding a strategy is one new file with a subclass of ``Strategy`` and
one ``STRATEGIES.register`` line (``trainrun.registry``; trainrun/wrappers/__init__.py
registers the shipped ones).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import re
import struct
import threading
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from trainrun.dist import barrier, is_main_process
from trainrun.messages import first_line
from trainrun.registry import STRATEGIES
from trainrun.wrappers.memory import ParamSpec, StateBytes, optimizer_tensors, replicated

log = logging.getLogger("trainrun")

# The runner's own state (rank 0's) inside a checkpoint that is a directory (fsdp, deepspeed).
TRAIN_STATE = "train_state.pt"

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
    ``teardown``. A checkpoint format of its own (a directory) overrides the classmethods
    ``owns_checkpoint``, ``look_inside``, ``read_state``, ``read_weights`` and
    ``model_shapes``; the runner, the checkpoint manager, export and test find it through
    ``checkpoint_format``, which asks the registered strategies. A strategy that shards or
    offloads overrides ``memory_plan`` (what ``--dry-run`` plans per rank) and, where it holds
    state outside the module and optimiser, ``state_tensors``; one that keeps only a part of
    each parameter on a rank overrides ``param_shards``, ``shards_written``, ``full_params``
    and ``shard_params``.

    The runner calls, in order: ``use_compile`` and ``configure``, then ``setup`` and
    ``optim_wrapper``; ``load_checkpoint`` or ``load_model_state_dict`` to start from a
    checkpoint; ``save_checkpoint`` (or ``save_checkpoint_async``) through its checkpoint
    manager; ``teardown`` when it closes. The config layer calls ``check_config`` before
    anything starts.

    Attributes:
        name: the strategy's name, as ``strategy.type`` gives it.
        OPTIONS: the options this strategy takes under ``strategy:`` in the config, with
            their defaults.
        WRAPPERS: the classes of the model ``setup`` returns (what ``is_model_wrapper``
            recognises): a class, or a class's name where importing its library only to ask
            would cost every run start-up time.
        WRITER_RANK: in a checkpoint of this strategy, a pattern matching the names of the
            files each rank writes itself (group 1 is the writer's rank); files it does not
            match (all, if None) are rank 0's.
        COMPILES: what ``setup`` compiles when the config's ``compile`` is on, in words for
            the plan; None: this strategy does not compile (the config refuses ``compile``
            for it).
        compile_options: the ``compile`` options ``use_compile`` gave; None: no compiling.
        options: the options given, over ``OPTIONS``' defaults.

    Args:
        **options: this strategy's options (the keys of ``OPTIONS``); those not given keep
            their defaults.

    Raises:
        ValueError: an option this strategy does not take (the message lists those it does).
    """

    name: ClassVar[str]
    # The options this strategy takes under `strategy:` in the config, with their defaults.
    OPTIONS: ClassVar[dict[str, Any]] = {}
    # What each option accepts, in words, for the config reference; each option's meaning is
    # the class docstring's ``Args:`` entry.
    ACCEPTS: ClassVar[dict[str, str]] = {}
    # The classes of the model `setup` returns (what `is_model_wrapper` recognises): a class, or
    # a class's name where importing its library only to ask would cost every run start-up time.
    WRAPPERS: ClassVar[tuple[type | str, ...]] = ()
    # In a checkpoint of this strategy, the names of the files each rank writes itself: group 1
    # is the writer's rank. Files it does not match (all, if None) are rank 0's.
    WRITER_RANK: ClassVar[re.Pattern[str] | None] = None
    # What `setup` compiles when the config's `compile` is on, in words for the plan; None: this
    # strategy does not compile (the config refuses `compile` for it).
    COMPILES: ClassVar[str | None] = None
    # The `compile` options (`COMPILE_DEFAULTS`' keys) `use_compile` gave; None: no compiling.
    compile_options: dict[str, Any] | None = None

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ValueError(
                f"strategy {self.name!r} takes no option {unknown[0]!r}; "
                f"its options are: {', '.join(sorted(self.OPTIONS)) or 'none'}"
            )
        self.options = {**self.OPTIONS, **options}
        self._writer: ThreadPoolExecutor | None = None  # background checkpoint writes

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
        path = Path(path)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return [file for file in files if self._writer_rank(file.name) == rank]

    def _writer_rank(self, name: str) -> int:
        found = self.WRITER_RANK.search(name) if self.WRITER_RANK is not None else None
        return int(found.group(1)) if found else 0

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
        if not is_main_process():
            done: Future = Future()
            done.set_result(None)
            return done
        state = copy_tensors(self._whole_state(model, optimizer, extra))
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainrun-save")
        return self._writer.submit(save_state_file, path, state)

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

    # ------------------------------------------------ the checkpoint format (no group needed)
    # A strategy whose checkpoints are in a format of its own (a directory) overrides
    # `owns_checkpoint` and the readers below; this default format is one torch file.

    @classmethod
    def owns_checkpoint(cls, path: Path) -> bool:
        """Whether ``path`` is a checkpoint in this strategy's own format; False (this
        default): the strategy has none, its checkpoints are ``Strategy``'s one torch file.

        Args:
            path: a file or directory.

        Returns:
            True for a checkpoint in this strategy's own format.
        """
        return False

    @classmethod
    def look_inside(cls, path: Path) -> None:
        """A cheap look that ``path`` is a readable checkpoint holding only tensors and plain
        containers (its tensors' data is not read); raises ValueError or UnpicklingError.

        Args:
            path: the checkpoint.

        Raises:
            ValueError: not a readable checkpoint (damaged, truncated, written by something
                else).
            pickle.UnpicklingError: it holds something other than tensors and plain
                containers.
        """
        load_mapped(path)

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        """The whole checkpoint as one plain state (model, optimiser, the runner's state).

        Args:
            path: the checkpoint.

        Returns:
            The state, with the model's under ``'model'`` and the optimiser's under
            ``'optimizer'``.
        """
        return load_torch_file(path)

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, torch.Tensor]:
        """The whole model's state, plain keys, read in this process with no group.

        Args:
            path: the checkpoint.

        Returns:
            The weights by the plain model's keys.
        """
        state = cls.read_state(path)
        return state.get("model", state)

    @classmethod
    def read_train_state(cls, path: Path) -> dict[str, Any]:
        """The runner's own state in the checkpoint (position, RNG states, the hooks' states),
        read in this process with no group.

        Args:
            path: the checkpoint.

        Returns:
            Everything but the model's and the optimiser's state.
        """
        state = cls.read_state(path)
        return {key: value for key, value in state.items() if key not in ("model", "optimizer")}

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of the model's state, from what the format records about
        them (the tensors themselves are not read).

        Args:
            path: the checkpoint.

        Returns:
            Each tensor's shape, by the plain model's keys.
        """
        state = load_mapped(path)
        model = state.get("model", state)
        return {key: tuple(value.shape) for key, value in model.items()
                if isinstance(value, torch.Tensor)}

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
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None


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


def copy_tensors(state: Any) -> Any:
    """``state`` with every tensor in its dicts, lists and tuples copied to new CPU memory:
    a snapshot that later training steps cannot change."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {key: copy_tensors(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copy_tensors(value) for value in state)
    return state


def save_state_file(path: str | os.PathLike, state: Any) -> None:
    """Write ``state`` to ``path`` with torch.save, on disk (fsynced) when this returns."""
    with open(path, "wb") as f:
        torch.save(state, f)
        fsync_and_hash(f, path)


# ---------------------------------------------------------------- content hashes

_CHUNK = 1 << 20
_KEPT = 1024  # hashes of written files kept at most (a checkpoint's manifest takes them)
_hashed_when_written: dict[str, tuple[tuple[int, int, int], str]] = {}
_hashed_lock = threading.Lock()


def sha256_of(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``, read from it."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib lets other threads run meanwhile
    return digest.hexdigest()


def _identity(path: str | os.PathLike) -> tuple[int, int, int]:
    found = os.stat(path)
    return found.st_ino, found.st_size, found.st_mtime_ns


def fsync_and_hash(f: IO[bytes], path: str | os.PathLike) -> None:
    """Put the file ``f`` (open at ``path``, completely written) on disk, and hash it from the
    page cache in another thread meanwhile: the hash costs no time of its own where the disk
    is the slower of the two. `written_sha256` hands it to the checkpoint's manifest."""
    f.flush()
    identity = _identity(path)
    hashed: list[str] = []
    hashing = threading.Thread(target=lambda: hashed.append(sha256_of(path)),
                               name="trainrun-hash")
    hashing.start()
    try:
        os.fsync(f.fileno())
    finally:
        hashing.join()
    with _hashed_lock:
        if len(_hashed_when_written) >= _KEPT:
            _hashed_when_written.clear()
        if hashed:
            _hashed_when_written[os.path.abspath(path)] = (identity, hashed[0])


def written_sha256(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``: the one `fsync_and_hash` took when this process
    wrote it, if the file has not changed since (same inode, size and modification time);
    else read from the file."""
    with _hashed_lock:
        found = _hashed_when_written.pop(os.path.abspath(path), None)
    if found is not None and found[0] == _identity(path):
        return found[1]
    return sha256_of(path)


# ---------------------------------------------------------------- checkpoint formats

def checkpoint_format(path: str | os.PathLike) -> type[Strategy]:
    """The strategy class that reads the checkpoint ``path``: the first registered one whose
    own format it is (`Strategy.owns_checkpoint`), else `Strategy`, whose format is one torch
    file."""
    for cls in STRATEGIES.values():
        if cls.owns_checkpoint(Path(path)):
            return cls
    return Strategy


def load_state_file(path: str) -> dict[str, Any]:
    """A checkpoint's content, refusing anything but tensors and plain containers; a
    checkpoint of a strategy's own format (a directory) comes back whole, as one plain
    state."""
    return checkpoint_format(path).read_state(Path(path))


def load_mapped(file: Path) -> Any:
    """A torch file's contents with its tensors memory-mapped (their data is not read): a cheap
    look inside, with `load_torch_file`'s refusals."""
    return load_torch_file(file, mmap=True)


def load_torch_file(file: str | os.PathLike, mmap: bool = False) -> Any:
    """A torch file's contents on the CPU, refusing anything but tensors and plain containers
    (`refusing_unsafe`); a file whose end is missing is a ValueError naming it as truncated
    (torch says "[Errno 22] Invalid argument", or a page about zip archives)."""
    with refusing_unsafe(file):
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as error:  # torch's failures on a cut file vary
            refuse_truncated(Path(file))
            if not (mmap and isinstance(error, RuntimeError) and "mmap" in str(error)):
                raise
        return torch.load(file, map_location="cpu", weights_only=True)  # an older, non-zip file


def refuse_truncated(file: Path) -> None:
    """A ValueError naming ``file`` as truncated if it begins as a zip archive (what torch
    writes), or as the first bytes of one, but has no end (an empty file included); only its
    first bytes and its end are read."""
    if not file.is_file():
        return
    with open(file, "rb") as f:
        begins = f.read(4)
    if b"PK\x03\x04".startswith(begins) and not zipfile.is_zipfile(file):
        raise ValueError(f"{file} is truncated: a torch file whose end is missing (its write "
                         f"did not finish, or the copy was cut short)")


@contextlib.contextmanager
def refusing_unsafe(path: str | os.PathLike) -> Iterator[None]:
    """Turn torch's page-long weights_only refusal inside the block into one line naming the
    refused global, and a file torch cannot read into a ValueError (bytes that are no pickle
    make torch's unpickler fail in many ways: an IndexError or KeyError from its stack and memo
    as often as an UnpicklingError)."""
    try:
        yield
    except pickle.UnpicklingError as error:
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(error))
        if not found:  # not a refusal: bytes that are no pickle at all
            raise ValueError(f"{path}: not a readable checkpoint (torch cannot read it: "
                             "written by something else, or damaged)") from None
        raise pickle.UnpicklingError(f"{path}: refused to load: it holds {found.group(1)}, "
                                     "which a checkpoint never needs (read with weights_only)"
                                     ) from None
    except RuntimeError as error:  # not a torch file, or a truncated one
        raise ValueError(f"{path}: not a readable checkpoint: "
                         f"{first_line(error)}") from None
    except (EOFError, IndexError, KeyError, UnicodeDecodeError, struct.error) as error:
        raise ValueError(f"{path}: not a readable checkpoint (torch cannot read it: "
                         f"written by something else, or damaged; {type(error).__name__})"
                         ) from None
