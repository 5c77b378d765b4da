"""Synthetic workload traces in the Mooncake JSONL format (``kvroute workload``).

``support-agent`` is the classic prefix-heavy case (docs/ARCHITECTURE.md, "Why a cache-aware
router"): every request starts with the same 512-token system prompt; conversation turns add
a 1,543-token few-shot block and then the conversation so far (each turn appends the previous
reply and a new user message); a share of one-off RAG requests follow the system prompt with a
long unique context.

::

    conversation turn:  [system 512][few-shot 1,543][u1][r1][u2][r2] ... [uk]
    RAG request:        [system 512][unique context 2k-6k][question]

Two held-out workloads of a different shape (issue 13: routing quality is reported on traffic
nobody tuned the cost on):

``zipf-tenants``: many tenants, each with its own system prompt; a request picks its tenant
by a Zipf law and follows the prompt with its own unique message. With the defaults (1,000
tenants, exponent 1.3, 60 req/s) the hottest tenant sends 28% of the requests (17 req/s),
more than one worker's share of a busy fleet even at 4 workers, so a router that pins a
prefix to one worker overloads it; the ten hottest send 65%, and the 1,000 prompts (2,000
tokens on average, 2M in all) do not fit one worker's 450k-token cache::

    request:  [tenant t's system prompt, 1k-3k][unique message 64-512]    t ~ Zipf(s)

``cold-bursts``: a steady stream of unique documents, and every few seconds a burst of 64
requests that arrive at the same millisecond and share a prefix nobody has seen yet (a new
2,000-token document), each with its own question -- the herding case: the first request of
a burst finds the prefix nowhere, and the other 63 arrive before any KV event::

    background:  [unique document 1k-4k][question]
    burst k:     [cold prefix k, 2,000][own question 16-256]   x 64, same timestamp

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

from edge.cli_help import HelpFormatter
from fleetsim.agentic import AgenticSessionsConfig, generate_agentic_sessions
from fleetsim.replay.trace import TraceRecord, write_trace

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


@dataclass(frozen=True, slots=True)
class ZipfTenantsConfig:
    """Shape of the zipf-tenants workload (module docstring)."""

    rate_rps: float = 60.0  # Poisson arrival rate of all requests
    duration_s: float = 90.0
    num_tenants: int = 1000
    zipf_s: float = 1.3  # tenant k (1-based) is picked with weight k ** -zipf_s
    seed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    system_tokens: tuple[int, int] = (1000, 3000)  # uniform range, drawn once per tenant
    user_tokens: tuple[int, int] = (64, 512)
    reply_tokens: tuple[int, int] = (32, 256)

    def __post_init__(self) -> None:
        _check_common(self.rate_rps, self.duration_s, self.seed, self.block_size)
        if self.num_tenants < 1:
            raise ValueError(f"num_tenants must be >= 1, got {self.num_tenants}")
        if not self.zipf_s > 0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s}")
        _check_ranges(self, ("system_tokens", "user_tokens", "reply_tokens"))

    def tenant_weights(self) -> list[float]:
        """Unnormalised pick weight of tenant k = 1..num_tenants: k ** -zipf_s."""
        return [k**-self.zipf_s for k in range(1, self.num_tenants + 1)]


@dataclass(frozen=True, slots=True)
class ColdBurstsConfig:
    """Shape of the cold-bursts workload (module docstring)."""

    rate_rps: float = 8.0  # Poisson rate of the background unique documents
    duration_s: float = 120.0
    burst_size: int = 64
    burst_interval_s: float = 5.0  # one burst every this many seconds (the first at half)
    seed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    burst_prefix_tokens: int = 2000
    burst_question_tokens: tuple[int, int] = (16, 256)
    document_tokens: tuple[int, int] = (1000, 4000)
    question_tokens: tuple[int, int] = (16, 128)
    reply_tokens: tuple[int, int] = (32, 256)

    def __post_init__(self) -> None:
        _check_common(self.rate_rps, self.duration_s, self.seed, self.block_size)
        if self.burst_size < 1:
            raise ValueError(f"burst_size must be >= 1, got {self.burst_size}")
        if not self.burst_interval_s > 0:
            raise ValueError(f"burst_interval_s must be > 0, got {self.burst_interval_s}")
        if self.burst_prefix_tokens < 1:
            raise ValueError(f"burst_prefix_tokens must be >= 1, got {self.burst_prefix_tokens}")
        _check_ranges(
            self, ("burst_question_tokens", "document_tokens", "question_tokens", "reply_tokens")
        )


def _check_common(rate_rps: float, duration_s: float, seed: int, block_size: int) -> None:
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps!r}")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")


def _check_ranges(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        lo, hi = getattr(config, name)
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")


def generate_zipf_tenants(config: ZipfTenantsConfig) -> list[TraceRecord]:
    """The zipf-tenants trace, sorted by timestamp; deterministic for ``config.seed``.

    Block ids: tenant t's system prompt blocks are ``(t, j)`` for blocks entirely inside it;
    every other block is the request's own (the block straddling the end of the prompt too,
    as in support-agent)."""
    rng = random.Random(config.seed)
    ids = _Ids()
    system = [rng.randint(*config.system_tokens) for _ in range(config.num_tenants)]
    tenants = list(range(config.num_tenants))
    weights = config.tenant_weights()
    bs = config.block_size
    records: list[TraceRecord] = []
    next_request = config.num_tenants  # families: tenants first, then one per request
    t = 0.0
    while True:
        t += rng.expovariate(config.rate_rps)
        if t >= config.duration_s:
            break
        tenant = rng.choices(tenants, weights)[0]
        input_length = system[tenant] + rng.randint(*config.user_tokens)
        num_shared = system[tenant] // bs
        hash_ids = [
            ids.get(tenant if j < num_shared else next_request, j)
            for j in range(-(-input_length // bs))
        ]
        next_request += 1
        records.append(
            TraceRecord(
                float(int(t * 1000)),
                input_length,
                rng.randint(*config.reply_tokens),
                tuple(hash_ids),
            )
        )
    return records


def generate_cold_bursts(config: ColdBurstsConfig) -> list[TraceRecord]:
    """The cold-bursts trace, sorted by timestamp; deterministic for ``config.seed``.

    Burst k's prefix blocks (entirely inside its ``burst_prefix_tokens``) are shared by its
    requests and by nothing else; every other block is the request's own."""
    rng = random.Random(config.seed)
    ids = _Ids()
    bs = config.block_size
    family = 0
    timed: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (t, order, ...)

    def own_blocks(n_tokens: int, shared_family: int | None, shared_tokens: int) -> tuple:
        nonlocal family
        family += 1
        num_shared = shared_tokens // bs if shared_family is not None else 0
        return tuple(
            ids.get(shared_family if j < num_shared else family, j)  # type: ignore[arg-type]
            for j in range(-(-n_tokens // bs))
        )

    t = 0.0
    while True:
        t += rng.expovariate(config.rate_rps)
        if t >= config.duration_s:
            break
        n = rng.randint(*config.document_tokens) + rng.randint(*config.question_tokens)
        out = rng.randint(*config.reply_tokens)
        timed.append((float(int(t * 1000)), len(timed), n, out, own_blocks(n, None, 0)))
    burst_t = config.burst_interval_s / 2
    while burst_t < config.duration_s:
        family += 1
        prefix_family = family
        ts = float(int(burst_t * 1000))
        for _ in range(config.burst_size):
            n = config.burst_prefix_tokens + rng.randint(*config.burst_question_tokens)
            out = rng.randint(*config.reply_tokens)
            blocks = own_blocks(n, prefix_family, config.burst_prefix_tokens)
            timed.append((ts, len(timed), n, out, blocks))
        burst_t += config.burst_interval_s
    timed.sort(key=lambda x: (x[0], x[1]))
    return [TraceRecord(ts, n, out, blocks) for ts, _, n, out, blocks in timed]


WORKLOADS = ("support-agent", "zipf-tenants", "cold-bursts", "agentic-sessions")
AnyConfig = SupportAgentConfig | ZipfTenantsConfig | ColdBurstsConfig | AgenticSessionsConfig


# option dest -> (workload, config field) of the options that belong to one workload
_SPECIFIC = {
    "conversations": ("support-agent", "num_conversations"),
    "rag_share": ("support-agent", "rag_share"),
    "system_tokens": ("support-agent", "system_tokens"),
    "fewshot_tokens": ("support-agent", "fewshot_tokens"),
    "max_prompt_tokens": ("support-agent", "max_prompt_tokens"),
    "tenants": ("zipf-tenants", "num_tenants"),
    "zipf_s": ("zipf-tenants", "zipf_s"),
    "burst_size": ("cold-bursts", "burst_size"),
    "burst_interval_s": ("cold-bursts", "burst_interval_s"),
    "burst_prefix_tokens": ("cold-bursts", "burst_prefix_tokens"),
}


def build_parser() -> argparse.ArgumentParser:
    sa, zt, cb = SupportAgentConfig(), ZipfTenantsConfig(), ColdBurstsConfig()
    ag = AgenticSessionsConfig()
    p = argparse.ArgumentParser(
        prog="kvroute workload",
        description="Generate a synthetic workload trace (Mooncake JSONL: timestamp ms, "
        "input_length, output_length, hash_ids) for 'kvroute replay'. support-agent: a shared "
        "system prompt, multi-turn conversations and one-off RAG requests; zipf-tenants: "
        "many tenants' system prompts picked by a Zipf law; cold-bursts: unique documents "
        "with bursts of requests on a cold shared prefix; agentic-sessions: tool agents, a "
        "shared tool spec and sessions of tens of turns growing to tens of thousands of "
        "tokens.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("name", choices=WORKLOADS, help="which workload")
    p.add_argument("-o", "--output", required=True, help="JSONL file to write")
    p.add_argument(
        "--rate",
        type=float,
        help=f"requests/s, Poisson (default: support-agent {sa.rate_rps:g}, zipf-tenants "
        f"{zt.rate_rps:g}, cold-bursts {cb.rate_rps:g} between the bursts, "
        f"agentic-sessions {ag.rate_rps:g} new sessions)",
    )
    p.add_argument(
        "--duration-s",
        type=float,
        help=f"trace length (default: support-agent {sa.duration_s:g}, zipf-tenants "
        f"{zt.duration_s:g}, cold-bursts {cb.duration_s:g}, agentic-sessions "
        f"{ag.duration_s:g})",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per hash id (pass the same to replay --trace-block-size)",
    )
    g = p.add_argument_group("support-agent")
    g.add_argument(
        "--conversations", type=int, help=f"live conversations (default {sa.num_conversations})"
    )
    g.add_argument(
        "--rag-share", type=float, help=f"fraction of one-off RAG requests (default {sa.rag_share})"
    )
    g.add_argument(
        "--system-tokens",
        type=int,
        help="tokens of the shared system prompt every request starts with "
        f"(default {sa.system_tokens})",
    )
    g.add_argument(
        "--fewshot-tokens",
        type=int,
        help="tokens of the few-shot block after the system prompt, conversations only "
        f"(default {sa.fewshot_tokens})",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="a conversation whose next prompt would exceed this starts over "
        f"(default {sa.max_prompt_tokens})",
    )
    g = p.add_argument_group("zipf-tenants")
    g.add_argument("--tenants", type=int, help=f"number of tenants (default {zt.num_tenants})")
    g.add_argument(
        "--zipf-s", type=float, help=f"Zipf exponent of tenant popularity (default {zt.zipf_s})"
    )
    g = p.add_argument_group("cold-bursts")
    g.add_argument("--burst-size", type=int, help=f"requests per burst (default {cb.burst_size})")
    g.add_argument(
        "--burst-interval-s",
        type=float,
        help=f"seconds between bursts (default {cb.burst_interval_s:g})",
    )
    g.add_argument(
        "--burst-prefix-tokens",
        type=int,
        help=f"tokens of each burst's cold shared prefix (default {cb.burst_prefix_tokens})",
    )
    return p


def _config(args: argparse.Namespace) -> AnyConfig:
    fields: dict[str, object] = {"seed": args.seed, "block_size": args.block_size}
    if args.rate is not None:
        fields["rate_rps"] = args.rate
    if args.duration_s is not None:
        fields["duration_s"] = args.duration_s
    for dest, (workload, field_name) in _SPECIFIC.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if workload != args.name:
            option = "--" + dest.replace("_", "-")
            raise ValueError(f"{option} applies to the {workload} workload, not {args.name}")
        fields[field_name] = value
    match args.name:
        case "support-agent":
            return SupportAgentConfig(**fields)  # type: ignore[arg-type]
        case "zipf-tenants":
            return ZipfTenantsConfig(**fields)  # type: ignore[arg-type]
        case "agentic-sessions":
            return AgenticSessionsConfig(**fields)  # type: ignore[arg-type]
        case _:
            return ColdBurstsConfig(**fields)  # type: ignore[arg-type]


def generate(config: AnyConfig) -> list[TraceRecord]:
    """The trace of any workload config."""
    match config:
        case SupportAgentConfig():
            return generate_support_agent(config)
        case ZipfTenantsConfig():
            return generate_zipf_tenants(config)
        case AgenticSessionsConfig():
            return generate_agentic_sessions(config)
        case _:
            return generate_cold_bursts(config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = _config(args)
    except ValueError as exc:
        print(f"kvroute workload: {exc}", file=sys.stderr)
        return 2
    records = generate(config)
    n = write_trace(args.output, records)
    tokens = sum(r.input_length for r in records)
    print(
        f"wrote {n} {args.name} requests ({tokens:,} prompt tokens, mean "
        f"{tokens / max(n, 1):,.0f}) to {args.output}; replay with --trace-block-size "
        f"{config.block_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
