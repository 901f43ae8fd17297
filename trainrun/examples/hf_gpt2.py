"""A Hugging Face ``transformers`` GPT-2 as a trainrun model (the optional extra ``hf``).

`HFGPT2` builds ``GPT2LMHeadModel(GPT2Config(...))`` from the config's sizes: its weights are
GPT-2's random initialisation drawn from the run's seed (the runner seeds before it builds
the model), never a download: nothing here calls ``from_pretrained`` or the Hugging Face Hub.
The module imports ``transformers`` at its top; where it is missing, naming the model in a
config is exit 2 saying which extra to install (``trainrun.registry.EXTRAS``).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel

from trainrun.examples.tinylm import VOCAB_SIZE
from trainrun.wrappers.base_model import BaseModel

IGNORE = -100  # the label of a padded position: cross_entropy's ignore_index


class HFGPT2(BaseModel):
    """GPT-2 (``transformers.GPT2LMHeadModel``, weights tied) over token ids.

    Batches are ``{'inputs', 'labels'}`` (int64, batch x length, labels the next tokens) and,
    when `pad_sequences` padded them, ``'inputs_mask'`` (True at real positions): it is the
    attention mask, and padded positions are left out of the loss. ``mode='loss'``: ``{'loss':
    mean cross-entropy over the batch's real tokens}``; ``mode='predict'``: each sample's mean
    loss over its real tokens, which ``MeanOf('val_loss')`` averages. The GPT-2 module is
    ``self.model``, so the state dict's keys are GPT-2's own behind ``model.``.

    Args:
        vocab_size: the number of token ids.
        block_size: the longest sequence (GPT-2's n_positions).
        n_layer: the number of GPT-2 blocks.
        n_head: attention heads per block (n_embd must be a multiple of it).
        n_embd: the width of the embeddings.
        dropout: GPT-2's residual, embedding and attention dropout, in [0, 1).
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, block_size: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1); got {dropout}")
        self.block_size = block_size
        config = GPT2Config(
            vocab_size=vocab_size, n_positions=block_size, n_layer=n_layer, n_head=n_head,
            n_embd=n_embd, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            bos_token_id=None, eos_token_id=None,  # GPT-2's (50256) are outside this vocabulary
            use_cache=False)  # training only: no key/value cache
        self.model = GPT2LMHeadModel(config)

    def forward(self, batch: dict[str, Tensor], mode: str = "loss") -> Any:
        return causal_lm_step(self.model, self.block_size, batch, mode)


def causal_lm_step(model: Any, block_size: int, batch: dict[str, Tensor], mode: str) -> Any:
    """A Hugging Face causal LM's ``forward`` for trainrun (see `HFGPT2`): ``{'loss': ...}`` in
    loss mode, each sample's mean loss over its real tokens in predict mode."""
    if mode not in ("loss", "predict"):
        raise ValueError(f"mode must be 'loss' or 'predict'; got {mode!r}")
    inputs, labels, mask = batch["inputs"], batch["labels"], batch.get("inputs_mask")
    if inputs.size(1) > block_size:
        raise ValueError(f"sequence of {inputs.size(1)} tokens is longer than block_size "
                         f"{block_size}")
    logits = model(input_ids=inputs, attention_mask=mask).logits
    if mask is not None:
        labels = labels.masked_fill(~mask, IGNORE)
    token_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                 ignore_index=IGNORE, reduction="none").view_as(labels)
    real = (labels != IGNORE).sum(1)
    if mode == "loss":
        return {"loss": token_loss.sum() / real.sum()}
    return token_loss.sum(1) / real
