"""Checkpoints: writing, publishing, verifying and reading them, whatever the strategy.

- ``manager``: names in ``work_dir/checkpoints``, publishing ``last``, pruning, finding a
  checkpoint by name; ``manifest``: the hashes written with each checkpoint, and verifying
  against them; ``files``: writes a crash never leaves half-done, fsync and hashing;
  ``safe_load``: reading torch files with nothing but tensors and plain containers.
- ``train_state``: the runner's own state in a checkpoint, from its stateful parts;
  ``resume``: choosing and verifying the checkpoint a run starts from; ``read``: reading any
  checkpoint by its path in one process.
- ``format``: what a checkpoint format is, and which one a checkpoint is in; one module per
  format: ``torch_file``, ``dcp``, ``deepspeed_dir``, ``mmengine_file`` (a checkpoint
  MMEngine wrote).

Adding a format is one new file with a ``CheckpointFormat`` subclass and one
``FORMATS.register`` line (below; the registry is ``trainrun.registry``'s). This package
imports no strategy: a strategy names the format it writes (``Strategy.FORMAT``).
"""

from __future__ import annotations

from trainrun.checkpoint.dcp import DCPDirectory
from trainrun.checkpoint.deepspeed_dir import DeepSpeedDirectory
from trainrun.checkpoint.format import CheckpointFormat, checkpoint_format
from trainrun.checkpoint.mmengine_file import MMEngineFile
from trainrun.checkpoint.torch_file import TorchFile
from trainrun.registry import FORMATS

FORMATS.register("torch_file", TorchFile)
FORMATS.register("dcp", DCPDirectory)
FORMATS.register("deepspeed", DeepSpeedDirectory)
FORMATS.register("mmengine", MMEngineFile)

__all__ = ["FORMATS", "CheckpointFormat", "DCPDirectory", "DeepSpeedDirectory", "MMEngineFile",
           "TorchFile", "checkpoint_format"]
