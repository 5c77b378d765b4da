"""``kvroute model init DIR``: a small model directory to serve, with no download.

``--model DIR`` needs an HF Llama-format directory; with no hub access a new user has none.
:func:`write_model_dir` writes one: the tiny random Llama (config.json, model.safetensors)
beside a real byte-level BPE tokenizer trained here (:func:`train_bpe`, with ``tokenizers``,
on seeded English-like text, so the same arguments give the same vocabulary) and a chat
template (tokenizer.json, tokenizer_config.json) -- what ``kvroute worker --model`` and
``kvroute router --model`` both load. Its weights are random: its text is noise, its
tokenizer, template, special tokens and EOS behave as a real model's do. Tests and
benchmarks use it too.

torch is imported only by :func:`write_model_dir` (the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from itertools import accumulate
from pathlib import Path
from typing import Any

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "SPECIAL_TOKENS",
    "english_like_text",
    "main",
    "train_bpe",
    "write_bpe_model_dir",
    "write_model_dir",
]

BOS = "<s>"
EOS = "</s>"
SPECIAL_TOKENS = (BOS, EOS, "<|start|>", "<|sep|>", "<|end|>")

# Llama-3-like: bos once, a header per turn, strict alternation after an optional system turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}"
    "{% endif %}"
    "<|start|>{{ message['role'] }}<|sep|>{{ message['content'] | trim }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)

_COMMON = (
    "the of and to in a is that for it as was with be by on not he I this are or his from "
    "at which but have an they you were her she there one all we their can been has more "
    "if will would who so no time about when what up out into some them could than other "
    "then only its over also new these two may first any like now my such our well after "
    "cache router worker prefix token block request model serving latency memory fleet "
    "attention prompt decode prefill hash index event stream batch queue policy system "
    "quickly brown fox jumps lazy dog river mountain morning evening question answer "
    "customer support agent order account refund shipping policy document paragraph "
    "summarise translate explain carefully politely number value result because however"
)
_WORDS = _COMMON.split()


_SYLLABLE_TEXT = (
    "ka to ri ne sa mo lu ter ban dis con pre pro ment tion able ing er ly al ous ive "
    "ex un re in com per trans graph log phon struct vert duc port form cap"
)
_SYLLABLES = _SYLLABLE_TEXT.split()


def _rare_words(rng: random.Random, num_rare: int) -> list[str]:
    """``num_rare`` distinct made-up words of 2-4 syllables (a long tail for big vocabs)."""
    words: dict[str, None] = {}
    while len(words) < num_rare:
        words["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))] = None
    return list(words)


def english_like_text(num_words: int, seed: int = 0, *, num_rare: int = 0) -> str:
    """Sentences of common English words (seeded), with punctuation, digits and a few
    accented words so byte-level merges see more than ASCII letters. ``num_rare`` made-up
    words, drawn Zipf-like, make one word in four, so a large vocabulary has merges to learn."""
    rng = random.Random(seed)
    extra = ("café", "naïve", "über", "résumé", "2024", "42", "3.14", "e-mail")
    rare = _rare_words(rng, num_rare)
    cum_weights = list(accumulate(1.0 / (rank + 1) for rank in range(len(rare))))
    out: list[str] = []
    n = 0
    while n < num_words:
        length = rng.randint(4, 14)
        words = [
            rng.choices(rare, cum_weights=cum_weights)[0]
            if rare and rng.random() < 0.25
            else rng.choice(_WORDS)
            if rng.random() > 0.04
            else rng.choice(extra)
            for _ in range(length)
        ]
        words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice((".", ".", ".", "?", "!", ",")))
        n += length
    return " ".join(out)


def train_bpe(
    vocab_size: int = 512, *, seed: int = 0, num_words: int = 20_000, num_rare: int = 0
) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` ids (the 256 byte
    symbols, :data:`SPECIAL_TOKENS`, then merges), trained on seeded English-like text
    (:func:`english_like_text`; a 32k vocabulary needs ``num_rare`` in the tens of
    thousands). Raises ValueError when the corpus cannot fill ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = english_like_text(num_words, seed, num_rare=num_rare)
    lines = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    tok.train_from_iterator(lines, trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(
            f"the corpus ({num_words} words) fills {got} of vocab_size={vocab_size} ids; "
            "give more num_words"
        )
    return tok


def write_model_dir(
    model_dir: str | Path, *, vocab_size: int = 512, seed: int = 0, chat_template: bool = True
) -> Path:
    """An HF model directory: the tiny random Llama (``vocab_size`` ids, bos = ``<s>``,
    eos = ``</s>``) and a BPE tokenizer (:func:`train_bpe`) with tokenizer_config.json
    (bos/eos tokens, ``add_bos_token``, :data:`CHAT_TEMPLATE` unless ``chat_template`` is
    False). Files are readable by all (0644), as a checkpoint others serve must be."""
    import dataclasses

    from worker.engine.loader import save_hf
    from worker.engine.model import build_tiny_model, tiny_config

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(vocab_size, seed=seed)
    # the bos in tokenizer.json as well: loaders that follow its post-processor and not
    # add_bos_token (transformers 5's generic fast tokenizer, so vLLM) encode as we do
    from tokenizers import processors

    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = tiny_config(vocab_size=vocab_size, eos_token_id=tok.token_to_id(EOS))
    cfg = dataclasses.replace(cfg, bos_token_id=tok.token_to_id(BOS))
    save_hf(build_tiny_model(seed, config=cfg), out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (out / name).chmod(0o644)  # safetensors writes its file 0600
    return out


write_bpe_model_dir = write_model_dir  # the name benchmarks and tests know


def main(argv: list[str] | None = None) -> int:
    """``kvroute model init DIR``."""
    parser = argparse.ArgumentParser(
        prog="kvroute model",
        description="Model directories for --model.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser(
        "init",
        help="write a small Llama-format directory (random weights, a real BPE tokenizer, "
        "a chat template) that kvroute worker/router/up --model serve",
    )
    init.add_argument("dir", help="the directory to write (must not exist, or be empty)")
    args = parser.parse_args(argv)
    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"kvroute model init: {out} exists and is not an empty directory", file=sys.stderr)
        return 2
    write_model_dir(out)
    print(f"wrote {out}: serve it with  kvroute up --workers 2 --http-port 8000 --model {out}")
    return 0
