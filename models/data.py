"""Corpus, held-out split, tokenizer and batching for the stree-tiny recipe (fully offline).

The corpus is the Python standard library's own source: it lies on every machine, needs no download, and
is identical wherever the Python version is the same (the model card records the version). Test suites
are left out (``test``/``tests``/``idle_test`` directories, ``test_*`` files), and so is anything under
``site-packages``, which differs from machine to machine.

Held-out files are picked by a hash of their relative path, so the split depends on nothing but the
file list: the same on every machine, stable when a file is added, independent of the seed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD]  # ids 0 and 1: the trainer adds special tokens first, in this order

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library (not the venv's site-packages)."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """Sorted ``*.py`` files under ``root`` (default: the stdlib), without tests or site-packages."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in _SKIP_DIRS for p in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        out.append(path)
    return out


def is_heldout(relpath: str, heldout_percent: float) -> bool:
    """Deterministic split by sha1 of the relative path (``/``-separated)."""
    h = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "big")
    return (h % 10_000) < heldout_percent * 100


@dataclass
class Corpus:
    """Texts of the train and held-out files (relative paths kept for the model card)."""

    root: str
    train_paths: list[str]
    heldout_paths: list[str]
    train_texts: list[str]
    heldout_texts: list[str]

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train_texts)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.heldout_texts)


def load_corpus(root: Path | None = None, heldout_percent: float = 5.0,
                max_files: int | None = None) -> Corpus:
    """Read the corpus and split it. ``max_files`` keeps every k-th file (spread over the tree) for smoke
    tests; at least one file lands on each side so both sides are never empty."""
    root = Path(root) if root is not None else stdlib_root()
    files = corpus_files(root)
    if max_files is not None and len(files) > max_files:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    train, held = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        # errors="replace": a handful of stdlib files carry latin-1 bytes in comments
        text = path.read_text(encoding="utf-8", errors="replace")
        (held if is_heldout(rel, heldout_percent) else train).append((rel, text))
    if not held and len(train) > 1:  # tiny slices: force one held-out file
        held.append(train.pop())
    if not train and len(held) > 1:
        train.append(held.pop(0))
    return Corpus(str(root), [r for r, _ in train], [r for r, _ in held],
                  [t for _, t in train], [t for _, t in held])


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer) with ``<|endoftext|>`` = id 0 as EOS/BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1
    return tok


def save_tokenizer(tok, out_dir: str | os.PathLike) -> None:
    """``tokenizer.json`` plus the small JSON files ``transformers.AutoTokenizer`` looks for."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
           "pad_token": PAD, "unk_token": None, "add_prefix_space": False,
           "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": EOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """One long int32 stream: ``EOS file1 EOS file2 ...`` (each file starts after an EOS, as a prompt
    prefixed with EOS would)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


class Batcher:
    """Random ``(batch, seq_len + 1)`` windows of a token stream, from a seeded generator (so a run is
    reproducible and independent of global RNG use elsewhere)."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if stream.numel() < seq_len + 2:
            raise ValueError(f"stream of {stream.numel()} tokens is shorter than seq_len + 2")
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both ``(batch, seq_len)`` int64."""
        hi = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, hi + 1, (self.batch_size,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        win = self.stream[idx].long()
        return win[:, :-1], win[:, 1:]


class MixedBatcher:
    """A :class:`Batcher`'s batches with their last ``round(batch_size * mix)`` rows replaced by rows of
    ``rows (n, seq_len + 1)`` picked at random (seeded). The corpus batcher draws whole batches
    whatever ``mix`` is, so its windows do not depend on the mixture."""

    def __init__(self, corpus: Batcher, rows: torch.Tensor, mix: float, seed: int):
        if rows.dim() != 2 or rows.shape[1] != corpus.seq_len + 1:
            raise ValueError(f"rows must be (n, {corpus.seq_len + 1}), got {tuple(rows.shape)}")
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {mix}")
        self.corpus, self.rows = corpus, rows
        self.k = round(corpus.batch_size * mix) if rows.shape[0] else 0
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both ``(batch, seq_len)`` int64."""
        x, y = self.corpus.next()
        if self.k == 0:
            return x, y
        picked = self.rows[torch.randint(0, self.rows.shape[0], (self.k,), generator=self.gen)].long()
        keep = x.shape[0] - self.k
        return torch.cat([x[:keep], picked[:, :-1]]), torch.cat([y[:keep], picked[:, 1:]])


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping ``(n, seq_len + 1)`` windows from the start of a stream (deterministic), spread
    evenly over the whole stream when ``max_windows`` caps them."""
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"held-out stream of {stream.numel()} tokens is shorter than seq_len + 1")
    picks = range(n)
    if max_windows is not None and n > max_windows:
        picks = [int(i * n / max_windows) for i in range(max_windows)]
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1].long() for i in picks])
