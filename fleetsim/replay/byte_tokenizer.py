"""A Hugging Face ``tokenizer.json`` with kvroute's byte-tokenizer ids, for peers' tokenizers.

Pure and synchronous: the files are built as JSON, no tokenizer library needed.

The live replay's text prompts are one ASCII character per token (:mod:`fleetsim.replay.
text_prompt`), and the sim workers and kvroute's router tokenize them with
``edge.tokenizer.ByteTokenizer``: byte ``b`` is id ``b``, then pad/bos/eos/unk are 256..259.
A router that tokenizes text itself to look up KV events (vllm-router's ``kv_aware``) or a
vLLM engine serving a model directory needs a tokenizer that gives the same ids: this one is
a byte-level BPE without merges (each byte one token; GPT-2's printable stand-in of byte
``b`` is vocabulary entry ``b``) and adds no BOS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 256..259, as ByteTokenizer's
BOS_ID, EOS_ID = 257, 258


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` document."""
    by_byte = bytes_to_unicode()
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 256 + i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, text in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {**level, "use_regex": False},
        "post_processor": None,
        "decoder": {**level, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {by_byte[b]: b for b in range(256)},
            "merges": [],
        },
    }


def write_byte_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIALS[0],
        "bos_token": SPECIALS[1],
        "eos_token": SPECIALS[2],
        "unk_token": SPECIALS[3],
        "add_bos_token": False,
        "model_max_length": 1 << 20,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
