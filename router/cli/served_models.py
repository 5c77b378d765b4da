"""The models a ``kvroute router`` serves, from ``--model`` and ``--served-model-name``
(both repeatable: one model pool each, router.core.pools, decision 0036).

    (neither)                      one pool, the byte tokenizer, named kvroute-tiny; a worker
                                   announcing another name forms a pool of that name
    --model A [--served-model-name N]   one pool (as before pools): every worker whose
                                   tokenizer is A's joins it, whatever it calls its model
    --served-model-name N          the same, with the byte tokenizer
    --model A --model B [--served-model-name NA --served-model-name NB]
                                   a pool each, with its own tokenizer (the directory's name
                                   unless named); a worker announcing another model is refused
    --served-model-name NA --served-model-name NB   the same with the byte tokenizer
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from edge.tokenizer import ChatTokenizer, load_tokenizer_or_bytes
from router.core.pools import PoolsConfig

__all__ = ["ServedModels", "load_served_models", "served_names"]


def served_names(models: list[str] | None, names: list[str] | None) -> list[str]:
    """The served model names, in order: the ``--served-model-name`` values, else each
    ``--model`` directory's name; [] when neither is given (ValueError on a mismatch)."""
    models, names = models or [], names or []
    if models and names and len(models) != len(names):
        raise ValueError(
            f"--served-model-name names each --model's pool in order: got {len(models)} "
            f"--model and {len(names)} --served-model-name"
        )
    out = names or [Path(m).resolve().name for m in models]
    if len(set(out)) != len(out):
        raise ValueError(
            f"served model names must differ, got {', '.join(out)} (name them with "
            "--served-model-name)"
        )
    if any(not name for name in out):
        raise ValueError("--served-model-name must not be empty")
    return out


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The pools and their tokenizers: ``tokenizer`` the first pool's (the byte tokenizer
    without --model), ``pool_tokenizers`` the other pools' own (several --model)."""

    pools: PoolsConfig | None  # None: the default (one pool open to announced names)
    tokenizer: ChatTokenizer
    pool_tokenizers: dict[str, ChatTokenizer] = field(default_factory=dict)

    @property
    def fingerprints(self) -> tuple[tuple[str, str], ...]:
        """(model, tokenizer fingerprint) of each pool with a tokenizer of its own."""
        return tuple((name, tok.fingerprint) for name, tok in self.pool_tokenizers.items())


def load_served_models(args: argparse.Namespace) -> ServedModels:
    """Load each --model's tokenizer (TokenizerLoadError) and name its pool (ValueError)."""
    models: list[str] = args.model or []
    names = served_names(models, args.served_model_name)
    tokenizer = load_tokenizer_or_bytes(models[0] if models else None)
    pool_tokenizers: dict[str, ChatTokenizer] = {}
    if len(models) > 1:  # each pool after the first with its own tokenizer
        for name, model in zip(names[1:], models[1:], strict=True):
            pool_tokenizers[name] = load_tokenizer_or_bytes(model)
    pools = PoolsConfig(tuple(names)) if names else None
    return ServedModels(pools, tokenizer, pool_tokenizers)
