"""A character-level transformer language model and a text corpus that ships with Python.

The corpus is the source of a fixed list of standard-library modules, so it is on every
machine that runs trainrun and nothing is downloaded. Its vocabulary is fixed (newline and
printable ASCII, everything else one unknown id), so the model's size never depends on the
machine: the text differs a little between Python versions, the vocabulary does not.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from trainrun.wrappers.base_model import BaseModel

# Plain modules (not packages) in every CPython from 3.10 on; about 750 KB together.
STDLIB_FILES = (
    "argparse.py", "calendar.py", "contextlib.py", "dataclasses.py", "difflib.py",
    "fractions.py", "functools.py", "heapq.py", "inspect.py", "pprint.py", "random.py",
    "statistics.py", "textwrap.py", "tokenize.py", "typing.py",
)
UNKNOWN_ID = 0
VOCAB = "\n" + "".join(chr(code) for code in range(32, 127))  # ids 1.. in this order
VOCAB_SIZE = len(VOCAB) + 1  # 97, the unknown id included
NEWLINE_ID = 1 + VOCAB.index("\n")
SPLITS = ("train", "val", "test")


def _byte_table() -> np.ndarray:
    """The id of every byte value: its character's place in VOCAB, else UNKNOWN_ID."""
    table = np.full(256, UNKNOWN_ID, dtype=np.uint8)
    for index, char in enumerate(VOCAB, start=1):
        table[ord(char)] = index
    return table


BYTE_TO_ID = _byte_table()


def encode(text: str | bytes) -> Tensor:
    """Token ids (int64) of ``text``, one per byte of its UTF-8 form."""
    data = text.encode() if isinstance(text, str) else text
    return torch.from_numpy(BYTE_TO_ID[np.frombuffer(data, dtype=np.uint8)].astype(np.int64))


def decode(ids: Tensor | Sequence[int]) -> str:
    """The text of token ids; the unknown id reads as U+FFFD."""
    chars = ("\ufffd",) + tuple(VOCAB)
    return "".join(chars[i] for i in torch.as_tensor(ids).tolist())


def stdlib_path(name: str) -> str:
    """``name`` inside this interpreter's standard library (absolute paths stay as they are)."""
    return os.path.join(sysconfig.get_paths()["stdlib"], name)


@lru_cache(maxsize=4)
def load_tokens(files: tuple[str, ...]) -> Tensor:
    """The files' bytes joined by newlines, as token ids (uint8 to keep it small), read once
    per process."""
    parts = []
    for name in files:
        path = stdlib_path(name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CharCorpus needs {path}, which this Python does not have; "
                                    f"pass files=[...] naming text files that exist")
        with open(path, "rb") as f:
            parts.append(f.read())
    data = b"\n".join(parts)
    return torch.from_numpy(BYTE_TO_ID[np.frombuffer(data, dtype=np.uint8)])


class CharCorpus(Dataset):
    """Fixed-length blocks of a character corpus for next-character prediction.

    Items are ``{'inputs': int64[block_size], 'labels': int64[block_size]}``, the labels being
    the inputs shifted by one character. The text is split by position: the last
    ``val_fraction`` is the validation split (the test split is the same text), so no block of
    one split overlaps the other. Blocks start every ``stride`` characters (``block_size``
    when not given: non-overlapping).

    Args:
        split: which split: train, val or test (test is the val text).
        block_size: the characters in a block.
        stride: characters between the starts of two blocks (null: block_size).
        val_fraction: the share of the text, at its end, in the validation split.
        files: text files to read instead of Python's standard-library sources.
    """

    DEFAULT_METRICS: ClassVar[list[str]] = ["val_loss"]
    vocab_size: ClassVar[int] = VOCAB_SIZE

    def __init__(self, split: str = "train", block_size: int = 64, stride: int | None = None,
                 val_fraction: float = 0.1, files: Sequence[str] | None = None):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be between 0 and 1; got {val_fraction}")
        tokens = load_tokens(tuple(files) if files is not None else STDLIB_FILES)
        cut = int(len(tokens) * (1 - val_fraction))
        self.tokens = tokens[:cut] if split == "train" else tokens[cut:]
        self.split = split
        self.block_size = block_size
        self.stride = stride or block_size
        if len(self.tokens) <= block_size:
            raise ValueError(f"the {split} text has {len(self.tokens)} characters, "
                             f"too few for one block of {block_size}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        start = index * self.stride
        chunk = self.tokens[start:start + self.block_size + 1].long()
        return {"inputs": chunk[:-1], "labels": chunk[1:]}


def line_pieces(tokens: Tensor, block_size: int, min_length: int) -> Tensor:
    """Where ``tokens`` is cut into pieces of whole lines: offsets ``o`` such that piece ``i``
    is ``tokens[o[i]:o[i + 1]]``.

    Front to back, each piece is the longest run of at most ``block_size + 1`` characters that
    ends with a line break and holds more than ``min_length`` characters; where no line break
    fits (a long line), the piece is cut at ``block_size + 1``. The last piece may be shorter;
    a final lone character is left out (it would predict nothing).
    """
    breaks = np.flatnonzero(tokens.numpy() == NEWLINE_ID)
    offsets, start, total = [0], 0, len(tokens)
    while total - start >= 2:
        limit = min(start + block_size + 1, total)  # the piece ends before this
        last = int(np.searchsorted(breaks, limit)) - 1  # the last break before limit
        start = int(breaks[last]) + 1 if last >= 0 and breaks[last] >= start + min_length \
            else limit
        offsets.append(start)
    return torch.tensor(offsets, dtype=torch.long)


class CharLines(CharCorpus):
    """`CharCorpus` text cut into pieces of whole lines, of varying length.

    Items are ``{'inputs': int64[n], 'labels': int64[n]}`` (labels: the inputs shifted by one
    character) with ``n`` between ``min_length`` and ``block_size``: a piece ends at the last
    line break that fits (see `line_pieces`), so samples differ in length and a batch needs a
    padding collate (``collate_fn: pad_sequences``). The pieces cover the split's text once,
    in order; which pieces a step sees is the sampler's business, so a resumed run sees the
    same ones.

    Args:
        split: which split: train, val or test (test is the val text).
        block_size: the longest piece, in characters.
        min_length: the shortest piece, in characters.
        val_fraction: the share of the text, at its end, in the validation split.
        files: text files to read instead of Python's standard-library sources.
    """

    def __init__(self, split: str = "train", block_size: int = 64, min_length: int = 16,
                 val_fraction: float = 0.1, files: Sequence[str] | None = None):
        if not 1 <= min_length <= block_size:
            raise ValueError(f"min_length must be between 1 and block_size ({block_size}); "
                             f"got {min_length}")
        super().__init__(split, block_size, val_fraction=val_fraction, files=files)
        self.offsets = line_pieces(self.tokens, block_size, min_length)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"piece {index} of {len(self)}")
        piece = self.tokens[self.offsets[index]:self.offsets[index + 1]].long()
        return {"inputs": piece[:-1], "labels": piece[1:]}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the ones before.

    ``qkv`` is one Linear whose output is q, k and v side by side; under tensor parallelism
    (``colwise_fused:3``) each rank holds its share of the heads of each, so the heads are
    counted from the output, not fixed.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.head_width = n_embd // n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        # (3, batch, heads, length, head width)
        q, k, v = self.qkv(x).view(batch, length, 3, -1, self.head_width).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(batch, length, -1)))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a 4x-wide MLP, each around a residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(BaseModel):
    """A small GPT-style language model over `CharCorpus` ids.

    ``mode='loss'``: ``{'loss': mean next-token cross-entropy}``; ``mode='predict'``: each
    sample's mean token loss (float, one per sample), which ``MeanOf('val_loss')`` averages.

    Args:
        vocab_size: the number of token ids.
        block_size: the longest sequence, in tokens.
        n_layer: the number of transformer blocks.
        n_head: attention heads per block (n_embd must be a multiple of it).
        n_embd: the width of the embeddings.
        dropout: the dropout probability.
        tie_weights: share the token embedding with the output layer.
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, block_size: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0,
                 tie_weights: bool = True):
        super().__init__()
        self.block_size = block_size
        self.token_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(_init_weights)
        if tie_weights:
            self.head.weight = self.token_emb.weight

    def logits(self, ids: Tensor) -> Tensor:
        """Next-token scores (batch, length, vocab) for token ids (batch, length)."""
        length = ids.size(1)
        if length > self.block_size:
            raise ValueError(f"sequence of {length} tokens is longer than block_size "
                             f"{self.block_size}")
        return self.pp_forward(ids)

    def forward(self, batch: dict[str, Tensor], mode: str = "loss") -> Any:
        if mode not in ("loss", "predict"):
            raise ValueError(f"mode must be 'loss' or 'predict'; got {mode!r}")
        return self.pp_outputs(self.logits(self.pp_inputs(batch)), batch, mode)

    # How pipeline parallelism (strategy.pp) runs the model in parts: between its blocks. A
    # stage holds some of the parts; the others are None (see trainrun.wrappers.pipeline).
    pp_blocks = "blocks"

    def pp_inputs(self, batch: dict[str, Tensor]) -> Tensor:
        """What the first stage takes: the token ids."""
        return batch["inputs"]

    def pp_forward(self, x: Tensor) -> Tensor:
        """Token ids to scores, through the parts this model holds: a pipeline stage without
        the embeddings takes the previous stage's activations, one without the head hands on
        its own."""
        if self.token_emb is not None:
            positions = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.token_emb(x) + self.pos_emb(positions))
        x = self.blocks(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x) if self.head is not None else x

    def pp_outputs(self, logits: Tensor, batch: dict[str, Tensor], mode: str) -> Any:
        """``forward``'s result from the scores: ``{'loss': ...}``, or each sample's loss."""
        labels = batch["labels"]
        token_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                     reduction="none").view_as(labels)
        if mode == "loss":
            return {"loss": token_loss.mean()}
        return token_loss.mean(1)

    def tp_plan(self) -> dict[str, str]:
        """How tensor parallelism (``strategy.tp``) splits this model: the vocabulary of the
        (tied) embedding and output layer, each block's heads and its MLP's hidden width. With
        ``strategy.sequence_parallel`` the blocks' input is cut along the sequence, and the
        norms compute each rank's part of it."""
        return {
            "token_emb": "vocab_embedding",
            "blocks": "sequence_split",
            "blocks.*.ln1": "sequence_parallel",
            "blocks.*.ln2": "sequence_parallel",
            "ln_f": "sequence_parallel",
            "blocks.*.attn.qkv": "colwise_fused:3",
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.0": "colwise",
            "blocks.*.mlp.2": "rowwise",
            "head": "colwise_gather_output",
        }

    @torch.no_grad()
    def generate(self, ids: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> Tensor:
        """``ids`` (batch, length) continued by ``max_new_tokens`` sampled tokens."""
        for _ in range(max_new_tokens):
            scores = self.logits(ids[:, -self.block_size:])[:, -1] / temperature
            next_id = torch.multinomial(scores.softmax(-1), 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
        return ids


def _init_weights(module: nn.Module) -> None:
    """Small normal weights and zero biases, as GPT-style models start."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
