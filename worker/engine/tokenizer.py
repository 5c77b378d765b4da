"""The worker's tokenizers: re-exported from :mod:`edge.tokenizer`, where they live
so the router tokenizes text prompts exactly as the worker does (same files, same ids)."""

from edge.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)

__all__ = ["ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "Tokenizer"]
