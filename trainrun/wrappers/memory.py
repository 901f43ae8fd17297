"""How many bytes of training state one rank holds, by kind: parameters, gradients and
optimiser state, on its device and offloaded to the CPU.

Planned before anything starts, from the model's shapes alone (`ParamSpec`, read from the
model built on the meta device), by each strategy's `Strategy.memory_plan`; measured in a
running job from the tensors the strategy holds (`Strategy.state_tensors`, counted by
`measure`). Both come as `StateBytes`, so the bench and the tests set one beside the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn

KINDS = ("params", "grads", "optim")
LABELS = {"params": "params", "grads": "grads", "optim": "optimiser state"}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a plan sees it: its name, shape and bytes per element in the model as
    built; ``trainable``: it has a gradient and optimiser state (requires_grad); ``states``:
    the optimiser's state tensors of its size (AdamW 2; None: not known for this optimiser)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    states: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_specs(model: nn.Module, states_of: Callable[[str], int | None]) -> list[ParamSpec]:
    """Every parameter of ``model`` once (shared ones under their first name), with the
    optimiser states ``states_of(name)`` gives a trainable one."""
    return [ParamSpec(name, tuple(param.shape), param.element_size(), param.requires_grad,
                      states_of(name) if param.requires_grad else 0)
            for name, param in model.named_parameters()]


def _zeros() -> dict[str, int]:
    return dict.fromkeys(KINDS, 0)


@dataclass
class StateBytes:
    """One rank's bytes by kind (`KINDS`) on its device and on the CPU (offloaded); planned
    figures are the most any rank holds. ``optim_known`` False: the optimiser's state size is
    not known (its bytes are left out); ``notes``: what the strategy says about its figures."""

    device: dict[str, int] = field(default_factory=_zeros)
    cpu: dict[str, int] = field(default_factory=_zeros)
    optim_known: bool = True
    notes: list[str] = field(default_factory=list)

    def add(self, kind: str, nbytes: float, cpu: bool = False) -> None:
        where = self.cpu if cpu else self.device
        where[kind] += int(nbytes)

    def add_optim(self, states: int | None, nbytes: float, cpu: bool = False) -> None:
        """``states`` optimiser tensors of ``nbytes`` each (None: not known)."""
        if states is None:
            self.optim_known = False
        else:
            self.add("optim", states * nbytes, cpu)

    def kind(self, kind: str) -> int:
        """Bytes of ``kind`` on the device and the CPU together."""
        return self.device[kind] + self.cpu[kind]

    @property
    def total(self) -> int:
        return sum(self.device.values()) + sum(self.cpu.values())


def replicated(specs: Iterable[ParamSpec], size: Callable[[ParamSpec], float] | None = None,
               cpu: bool = False) -> StateBytes:
    """Each parameter, its gradient (if trainable) and its optimiser states, ``size(spec)``
    bytes each (the whole tensor where not given): what every rank holds under a strategy
    that does not shard."""
    plan = StateBytes()
    for spec in specs:
        nbytes = size(spec) if size is not None else spec.numel * spec.itemsize
        plan.add("params", nbytes, cpu)
        if spec.trainable:
            plan.add("grads", nbytes, cpu)
            plan.add_optim(spec.states, nbytes, cpu)
    return plan


def storage_bytes(tensors: Iterable[Tensor | None], seen: set[int]) -> tuple[int, int]:
    """Bytes (device, CPU) of the storages behind ``tensors`` not in ``seen`` (which grows):
    every storage counted once, however many tensors view it. A DTensor counts its local
    shard."""
    device = cpu = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if not storage.nbytes() or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if local.device.type == "cpu":
            cpu += storage.nbytes()
        else:
            device += storage.nbytes()
    return device, cpu


def measure(tensors: Mapping[str, Iterable[Tensor | None]], on_cpu_device: bool = False
            ) -> StateBytes:
    """The bytes of the tensors of each kind (a storage counted under the first kind that
    holds it, in `KINDS` order). ``on_cpu_device``: the job computes on the CPU, so CPU
    tensors are its device's (nothing is offloaded)."""
    found = StateBytes()
    seen: set[int] = set()
    for kind in KINDS:
        device, cpu = storage_bytes(tensors.get(kind, ()), seen)
        found.add(kind, device + (cpu if on_cpu_device else 0))
        if not on_cpu_device:
            found.add(kind, cpu, cpu=True)
    return found


class PeakWatch:
    """The most bytes of each kind a running job's rank held, measured (`measure`) just before
    and just after every step of its torch optimiser(s), and whenever `take` is called (after
    each training step, say: ZeRO-3 gathers its small parameters again only then): before
    the step the gradients are there (reduced, and under DeepSpeed also in fp32 for the
    step); after it, the optimiser's state. ``tensors()`` gives the tensors by kind
    (`Strategy.state_tensors` of the run's model)."""

    def __init__(self, optimizer: object, tensors: Callable[[], Mapping[str, Iterable[Tensor]]],
                 on_cpu_device: bool = True):
        self.peak = StateBytes()
        self.steps = 0
        self._tensors, self._on_cpu = tensors, on_cpu_device
        optimizers = optimizer.values() if isinstance(optimizer, Mapping) else [optimizer]
        self._handles = [handle for one in optimizers for handle in (
            one.register_step_pre_hook(self.take), one.register_step_post_hook(self._stepped))]

    def take(self, *_: object) -> None:
        found = measure(self._tensors(), self._on_cpu)
        for kind in KINDS:
            self.peak.device[kind] = max(self.peak.device[kind], found.device[kind])
            self.peak.cpu[kind] = max(self.peak.cpu[kind], found.cpu[kind])

    def _stepped(self, *_: object) -> None:
        self.steps += 1
        self.take()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def optimizer_tensors(optimizer: object) -> list[Tensor]:
    """The optimiser's state tensors (scalar step counters left out); one optimiser, or a
    dict of them."""
    optimizers = optimizer.values() if isinstance(optimizer, Mapping) else [optimizer]
    return [value for one in optimizers if one is not None
            for state in one.state.values() for value in state.values()
            if isinstance(value, Tensor) and value.dim() > 0]
