"""Synthetic workload traces in the Mooncake JSONL format (``kvroute workload``).

``support-agent`` is the classic prefix-heavy case (docs/ARCHITECTURE.md, "Why a cache-aware
router"): every request starts with the same 512-token system prompt; conversation turns add
a 1,543-token few-shot block and then the conversation so far (each turn appends the previous
reply and a new user message); a share of one-off RAG requests follow the system prompt with a
long unique context.

::

    conversation turn:  [system 512][few-shot 1,543][u1][r1][u2][r2] ... [uk]
    RAG request:        [system 512][unique context 2k-6k][question]

Mapping content to hash ids. The format names content by ids of fixed-size blocks
(``--block-size`` B tokens; pass the same value to ``kvroute replay --trace-block-size``),
and 512 + 1,543 = 2,055 is not block-aligned for any B > 1. The rule:

- block j (positions [jB, (j+1)B)) that lies entirely inside the request's shared prefix
  (512 tokens for RAG, 2,055 for a conversation) gets the shared id ``("shared", j)``;
- every other block belongs to the request's family -- its conversation, or the RAG request
  itself -- and gets the id ``(family, j)``.

Ids are interned to small integers in order of first use. Because a conversation only ever
appends, block j of a conversation covers the same content at every turn, and a partial last
block is a prefix of the full block a later turn sees: token expansion cuts the block, so
prefixes are exact. The one approximation: the block that straddles the end of the shared
prefix (positions 2048..2063 at B=16) belongs to the conversation, so the trace shares
floor(2055/B)*B tokens (2,048 at B=16) instead of 2,055; B=1 is exact but makes big files.
Also, replayed engines cache their own generated tokens, which differ from the tokens the
trace expands for the reply, so a turn re-uses the previous turn's prompt, not its reply.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from bench.replay.trace import TraceRecord, write_trace
from kvroute_proto.cli_help import HelpFormatter

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SupportAgentConfig:
    """Shape of the support-agent workload."""

    rate_rps: float = 20.0  # Poisson arrival rate of all requests
    duration_s: float = 300.0
    num_conversations: int = 200  # conversations live at any time
    rag_share: float = 0.2  # fraction of requests that are one-off RAG requests
    seed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    system_tokens: int = 512
    fewshot_tokens: int = 1543
    user_tokens: tuple[int, int] = (16, 256)  # uniform range of a user message
    reply_tokens: tuple[int, int] = (32, 384)  # uniform range of output_length
    max_turns: tuple[int, int] = (3, 16)  # uniform range of a conversation's length
    rag_context_tokens: tuple[int, int] = (2000, 6000)
    rag_question_tokens: tuple[int, int] = (16, 128)
    max_prompt_tokens: int = 7680  # prompt + reply stays under an 8,192-token context

    def __post_init__(self) -> None:
        checks = [
            ("rate_rps", self.rate_rps > 0, "must be > 0"),
            ("duration_s", self.duration_s > 0, "must be > 0"),
            ("num_conversations", self.num_conversations >= 1, "must be >= 1"),
            ("rag_share", 0.0 <= self.rag_share <= 1.0, "must be in [0, 1]"),
            ("seed", self.seed >= 0, "must be >= 0"),
            ("block_size", self.block_size >= 1, "must be >= 1"),
            ("system_tokens", self.system_tokens >= 1, "must be >= 1"),
            ("fewshot_tokens", self.fewshot_tokens >= 0, "must be >= 0"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")
        ranges = ("user_tokens", "reply_tokens", "max_turns", "rag_context_tokens")
        for name in (*ranges, "rag_question_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        longest_first = self.system_tokens + self.fewshot_tokens + self.user_tokens[1]
        if self.max_prompt_tokens < longest_first:
            raise ValueError(
                f"max_prompt_tokens must be >= {longest_first} (prefix + longest user "
                f"message), got {self.max_prompt_tokens}"
            )
        longest_rag = self.system_tokens + self.rag_context_tokens[1] + self.rag_question_tokens[1]
        if self.max_prompt_tokens < longest_rag:
            raise ValueError(
                f"max_prompt_tokens must be >= {longest_rag} (system + longest RAG context "
                f"and question), got {self.max_prompt_tokens}"
            )


@dataclass(slots=True)
class _Conversation:
    family: int
    length: int  # tokens of the prompt so far, before the next user message
    turns_left: int
    last_reply: int = 0


class _Ids:
    """Interns (family, block index) keys into small consecutive ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def get(self, family: int, block: int) -> int:
        key = (family, block)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found

    def __len__(self) -> int:
        return len(self._ids)


_SHARED = -1  # family of the shared-prefix blocks


def _hash_ids(ids: _Ids, family: int, shared_len: int, input_length: int, bs: int) -> list[int]:
    num_blocks = -(-input_length // bs)
    num_shared = shared_len // bs  # blocks entirely inside the shared prefix
    return [ids.get(_SHARED if j < num_shared else family, j) for j in range(num_blocks)]


def generate_support_agent(config: SupportAgentConfig) -> list[TraceRecord]:
    """The support-agent trace, sorted by timestamp; deterministic for ``config.seed``."""
    rng = random.Random(config.seed)
    ids = _Ids()
    prefix = config.system_tokens + config.fewshot_tokens
    next_family = 0

    def new_conversation() -> _Conversation:
        nonlocal next_family
        next_family += 1
        return _Conversation(next_family, prefix, rng.randint(*config.max_turns))

    live = [new_conversation() for _ in range(config.num_conversations)]
    records: list[TraceRecord] = []
    t = 0.0
    while True:
        t += rng.expovariate(config.rate_rps)
        if t >= config.duration_s:
            break
        ts_ms = float(int(t * 1000))
        output_length = rng.randint(*config.reply_tokens)
        if rng.random() < config.rag_share:
            next_family += 1
            input_length = (
                config.system_tokens
                + rng.randint(*config.rag_context_tokens)
                + rng.randint(*config.rag_question_tokens)
            )
            hash_ids = _hash_ids(
                ids, next_family, config.system_tokens, input_length, config.block_size
            )
        else:
            slot = rng.randrange(len(live))
            conv = live[slot]
            user = rng.randint(*config.user_tokens)
            input_length = conv.length + conv.last_reply + user
            if input_length > config.max_prompt_tokens or conv.turns_left <= 0:
                conv = live[slot] = new_conversation()
                input_length = conv.length + user
            hash_ids = _hash_ids(ids, conv.family, prefix, input_length, config.block_size)
            conv.length = input_length
            conv.last_reply = output_length
            conv.turns_left -= 1
        records.append(TraceRecord(ts_ms, input_length, output_length, tuple(hash_ids)))
    return records


WORKLOADS = {"support-agent"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute workload",
        description="Generate a synthetic workload trace (Mooncake JSONL: timestamp ms, "
        "input_length, output_length, hash_ids) for 'kvroute replay'.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("name", choices=sorted(WORKLOADS), help="which workload")
    p.add_argument("-o", "--output", required=True, help="JSONL file to write")
    d = SupportAgentConfig()
    p.add_argument("--rate", type=float, default=d.rate_rps, help="requests/s (Poisson)")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="trace length")
    p.add_argument(
        "--conversations", type=int, default=d.num_conversations, help="live conversations"
    )
    p.add_argument(
        "--rag-share", type=float, default=d.rag_share, help="fraction of one-off RAG requests"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="random seed")
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per hash id (pass the same to replay --trace-block-size)",
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=d.system_tokens,
        help="tokens of the shared system prompt every request starts with",
    )
    p.add_argument(
        "--fewshot-tokens",
        type=int,
        default=d.fewshot_tokens,
        help="tokens of the few-shot block after the system prompt (conversations only)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=d.max_prompt_tokens,
        help="a conversation whose next prompt would exceed this starts over",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = SupportAgentConfig(
            rate_rps=args.rate,
            duration_s=args.duration_s,
            num_conversations=args.conversations,
            rag_share=args.rag_share,
            seed=args.seed,
            block_size=args.block_size,
            system_tokens=args.system_tokens,
            fewshot_tokens=args.fewshot_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
        )
    except ValueError as exc:
        print(f"kvroute workload: {exc}", file=sys.stderr)
        return 2
    records = generate_support_agent(config)
    n = write_trace(args.output, records)
    tokens = sum(r.input_length for r in records)
    print(
        f"wrote {n} requests ({tokens:,} prompt tokens, mean {tokens / max(n, 1):,.0f}) "
        f"to {args.output}; replay with --trace-block-size {config.block_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
