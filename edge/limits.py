"""What a kvroute service accepts in one GenerateRequest, whichever front door it came in by.

One set of limits for both services: the router rejects what no worker could serve before
spending a route on it (``router.service.validation.check_request``: request id, prompt
tokens and text bytes, max_new_tokens, stop ids), the worker while decoding the request
(``worker.service.convert``: request id, prompt text characters, and the default
max_new_tokens it fills in). Each side reads the fields it checks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestLimits"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Service-level limits of one GenerateRequest."""

    max_request_id_chars: int = 256  # router and worker
    max_prompt_tokens: int = 1 << 20  # router: prompt_token_ids
    max_prompt_text_bytes: int = 4 << 20  # router: prompt_text, UTF-8
    max_new_tokens: int = 1 << 20  # router: sampling.max_new_tokens
    max_stop_token_ids: int = 256  # router: sampling.stop_token_ids
    max_stop_strings: int = 4  # router: sampling.stop (OpenAI's limit)
    max_stop_chars: int = 256  # router: each stop string
    max_logit_bias: int = 300  # router: sampling.logit_bias entries (OpenAI's limit)
    max_top_logprobs: int = 20  # router and worker: sampling.top_logprobs (OpenAI's limit)
    max_prompt_text_chars: int = 1 << 20  # worker: the text it tokenizes
    # worker: used when sampling.max_new_tokens is 0; 0 here: what is left of the context
    # (OpenAI's and vLLM's default for chat; docs/decisions/0032)
    default_max_new_tokens: int = 0
