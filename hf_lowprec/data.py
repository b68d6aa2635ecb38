"""Embedded defaults that need no hub: a text corpus, a locally trained tokenizer, tiny models.

The corpus is the documentation the Python interpreter ships for its own standard library
(docstrings, PSF-licensed), read at run time, so nothing is downloaded and nothing large is
committed. The byte-level BPE tokenizer is trained on it with `tokenizers` and cached.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "embedded_corpus",
    "build_tokenizer",
    "cache_dir",
    "tiny_gpt2_config",
    "tiny_bert_config",
    "TokenBlocks",
    "clm_datasets",
]

_CORPUS_MODULES = [
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "mimetypes",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shelve",
    "shlex",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unittest",
    "urllib",
    "uuid",
    "warnings",
    "weakref",
    "xml",
    "zipfile",
    "zoneinfo",
]


def cache_dir() -> Path:
    """Where built artefacts (the tokenizer) are cached: $HF_LOWPREC_CACHE or ~/.cache/hf_lowprec."""
    root = os.environ.get("HF_LOWPREC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_lowprec")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def embedded_corpus() -> list[str]:
    """Paragraphs of the standard library's own docstrings, in a fixed order."""
    paragraphs: list[str] = []
    for name in _CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(module)]
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == name:
                docs.append(inspect.getdoc(obj))
        for doc in docs:
            if not doc:
                continue
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 40:
                    paragraphs.append(para)
    if not paragraphs:
        raise RuntimeError("the interpreter ships no docstrings (python -OO?); the embedded corpus is empty")
    return paragraphs


def build_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer trained on the embedded corpus, cached on disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = cache_dir() / f"bpe-{vocab_size}.json"
    if not path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>", "<pad>", "<mask>", "<cls>", "<sep>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(embedded_corpus(), trainer=trainer)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        mask_token="<mask>",
        cls_token="<cls>",
        sep_token="<sep>",
        unk_token="<unk>",
    )


def tiny_gpt2_config(vocab_size: int = 1024, **overrides: Any) -> Any:
    """A GPT-2 config small enough to train on 2 CPU cores in seconds."""
    from transformers import GPT2Config

    kwargs = dict(
        vocab_size=vocab_size,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_bert_config(vocab_size: int = 1024, **overrides: Any) -> Any:
    """A BERT config of the same size as `tiny_gpt2_config`."""
    from transformers import BertConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
        pad_token_id=1,
    )
    kwargs.update(overrides)
    return BertConfig(**kwargs)


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of token ids, each item `{"input_ids", "labels"}` for causal LM."""

    def __init__(self, ids: list[int], block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        n = len(ids) // block_size
        if n == 0:
            raise ValueError(f"{len(ids)} tokens make no block of {block_size}; use a smaller block_size")
        self.blocks = torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        return {"input_ids": block, "labels": block.clone()}


def clm_datasets(
    tokenizer: Any, block_size: int = 64, eval_fraction: float = 0.1, seed: int = 0
) -> tuple[TokenBlocks, TokenBlocks]:
    """Train and eval causal-LM blocks from the embedded corpus (paragraphs split at random, fixed seed)."""
    paragraphs = embedded_corpus()
    random.Random(seed).shuffle(paragraphs)
    n_eval = max(1, int(len(paragraphs) * eval_fraction))
    eos = tokenizer.eos_token_id

    def ids(paras: list[str]) -> list[int]:
        out: list[int] = []
        for enc in tokenizer(paras)["input_ids"]:
            out.extend(enc)
            out.append(eos)
        return out

    return TokenBlocks(ids(paragraphs[n_eval:]), block_size), TokenBlocks(ids(paragraphs[:n_eval]), block_size)
