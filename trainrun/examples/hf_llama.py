"""A Hugging Face ``transformers`` Llama as a trainrun model (the optional extra ``hf``), built
from a small config: random weights from the run's seed, nothing downloaded.

Its tensor-parallel plan is Llama's own (``LlamaConfig.base_model_tp_plan``, and
``lm_head`` from ``LlamaForCausalLM``), which strategy 'fsdp' uses under ``strategy.tp``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from trainrun.examples.hf_gpt2 import causal_lm_step
from trainrun.examples.tinylm import VOCAB_SIZE
from trainrun.wrappers.base_model import BaseModel


class HFLlama(BaseModel):
    """Llama (``transformers.LlamaForCausalLM``) over token ids; batches and modes as
    `HFGPT2`'s. The Llama module is ``self.model``.

    Args:
        vocab_size: the number of token ids.
        block_size: the longest sequence (max_position_embeddings).
        n_layer: the number of decoder layers.
        n_head: attention heads per layer (n_embd must be a multiple of it).
        n_kv_head: key/value heads (grouped-query attention; n_head must be a multiple of it).
        n_embd: the width of the embeddings.
        mlp_width: the MLP's hidden width (intermediate_size).
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, block_size: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_kv_head: int = 2, n_embd: int = 128, mlp_width: int = 344):
        super().__init__()
        if n_embd % n_head or n_head % n_kv_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head}), and "
                             f"n_head of n_kv_head ({n_kv_head})")
        self.block_size = block_size
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, max_position_embeddings=block_size, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=n_kv_head, hidden_size=n_embd,
            intermediate_size=mlp_width, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, use_cache=False))

    def forward(self, batch: dict[str, Tensor], mode: str = "loss") -> Any:
        return causal_lm_step(self.model, self.block_size, batch, mode)
