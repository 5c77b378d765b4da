"""The BPE tokenizer and small model directory benchmarks use: ``worker.model_dir`` (what
``kvroute model init`` writes), re-exported under the names benchmarks and tests know."""

from worker.model_dir import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIAL_TOKENS,
    english_like_text,
    train_bpe,
    write_bpe_model_dir,
)

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "SPECIAL_TOKENS",
    "english_like_text",
    "train_bpe",
    "write_bpe_model_dir",
]
