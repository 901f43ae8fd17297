"""How a strategy holds the model's state on a rank, by default all of it: `Sharding`.

``Strategy`` inherits these defaults, which suit every strategy whose ranks each hold the
whole model, its gradients and its optimiser state. A strategy that keeps only a part of each
parameter on a rank overrides the first four (``param_shards``, ``shards_written``,
``full_params``, ``shard_params``); one that shards or offloads overrides ``memory_plan`` and,
where it holds state outside the module and optimiser, ``state_tensors``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from trainrun.checkpoint.optimizer_state import Optimizers
from trainrun.wrappers.memory import ParamSpec, StateBytes, optimizer_tensors, replicated


class Sharding:
    """A strategy's share of the model's state on a rank, and the memory it plans and holds.

    This rank's share of the parameters is what a hook that keeps a copy of the weights
    beside the model (EMA) works on, so that its copy is sharded as the model is; the memory
    is what ``--dry-run`` plans before anything starts, and what a running job holds, by kind
    (trainrun/wrappers/memory.py). These defaults are the replicated case: every rank holds
    the whole model, its gradients and its optimiser state. A base of ``Strategy``, whose
    ``unwrap`` they use.
    """

    unwrap: Callable[[nn.Module], nn.Module]

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

    def shards_written(self, model: nn.Module) -> None:
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

    def measure_inside_step(self, take: Callable[[], None]) -> None:
        """Have ``take`` called wherever inside a training step this strategy's state peaks
        apart from around the optimiser's step (which ``memory.PeakWatch`` measures itself).
        This default: nowhere else.

        Args:
            take: records the memory held at the moment it is called.
        """
