"""Which HTTP front end a live replay plays its trace through, and how to start it.

Pure and synchronous (no process is started here): parsing ``--front`` and building the
command line of each front. ``fleetsim/replay/live_http.py`` runs them.

``--front`` values::

    kvroute[:POLICY]          our router (``kvroute router --http-port``); POLICY from the
                              router's registry, default: each ``--policy`` of the replay
    sglang-router[:POLICY]    SGLang's gateway (sglang-router 0.3.2), default cache_aware
    vllm-router[:POLICY]      vLLM's router (vllm-router 0.1.17), default cache_aware
    http://HOST:PORT          any OpenAI-compatible endpoint already running (nothing is
                              started; it must already front the workers it serves)

The peers live in their own virtualenvs under ``.peers/`` (``bench/peers/install_peers.sh``),
never in the project's dependencies. They always bind 127.0.0.1, their metrics too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PEERS_DIR = REPO_ROOT / ".peers"

KVROUTE = "kvroute"
SGLANG_ROUTER = "sglang-router"
VLLM_ROUTER = "vllm-router"
URL = "url"

# Policies each peer can run in front of kvroute workers. sglang-router's "manual" needs a
# routing header per request. vllm-router's "kv_aware" reads the workers' KV events in vLLM's
# ZMQ wire (kvroute worker --kv-events-zmq, started so for it) and tokenizes the text prompts
# with a byte tokenizer written for it (fleetsim.replay.byte_tokenizer).
PEER_POLICIES: dict[str, tuple[str, ...]] = {
    SGLANG_ROUTER: ("cache_aware", "round_robin", "random", "power_of_two"),
    VLLM_ROUTER: (
        "cache_aware",
        "round_robin",
        "random",
        "power_of_two",
        "consistent_hash",
        "sticky_least_loaded",
        "kv_aware",
    ),
}
KV_AWARE = "kv_aware"
_REFUSED: dict[tuple[str, str], str] = {
    (SGLANG_ROUTER, "manual"): "routes by a per-request header the replay does not send",
}
PEER_DEFAULT_POLICY = "cache_aware"
# the peers' launchers, run with the venv's python: python -m MODULE
PEER_MODULES = {
    SGLANG_ROUTER: "sglang_router.launch_router",
    VLLM_ROUTER: "vllm_router.launch_router",
}
PEER_VENVS = {SGLANG_ROUTER: "sglang", VLLM_ROUTER: "vllm"}


class FrontSpecError(ValueError):
    """A ``--front`` value that names no known front end or policy."""


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One worker's vLLM-wire KV events, for vllm-router's ``kv_aware``: its HTTP URL, the
    PUB endpoint and the replay endpoint."""

    worker_url: str
    pub: str
    replay: str


@dataclass(frozen=True, slots=True)
class FrontSpec:
    """One front end: ``kind`` (kvroute, sglang-router, vllm-router, url) and its policy.

    ``policy`` is None for ``kvroute`` without one (the replay's ``--policy`` values apply)
    and for a URL (its policy is whatever it was started with).
    """

    kind: str
    policy: str | None = None
    url: str | None = None

    @property
    def label(self) -> str:
        """The report's row name: ``sglang-router:cache_aware``, ``http://...``."""
        if self.kind == URL:
            return str(self.url)
        return f"{self.kind}:{self.policy}" if self.policy else self.kind

    @property
    def reads_zmq_events(self) -> bool:
        """True for vllm-router's kv_aware: its workers must publish vLLM's ZMQ events."""
        return self.kind == VLLM_ROUTER and self.policy == KV_AWARE

    @property
    def starts_fleet(self) -> bool:
        """False for a URL: it already fronts its own workers."""
        return self.kind != URL


def parse_front(value: str, kvroute_policies: Sequence[str] = ()) -> FrontSpec:
    """Parse one ``--front`` value; ``kvroute_policies`` is the router's policy registry."""
    text = value.strip()
    if not text:
        raise FrontSpecError("--front must not be empty")
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FrontSpecError(
                f"--front {value!r}: a URL must be http(s)://HOST[:PORT] of a running "
                "OpenAI-compatible endpoint"
            )
        try:
            parts.port  # noqa: B018 -- raises on a bad port
        except ValueError as exc:
            raise FrontSpecError(f"--front {value!r}: {exc}") from None
        return FrontSpec(URL, url=text.rstrip("/"))
    kind, _, policy = text.partition(":")
    if kind == KVROUTE:
        if not policy:
            return FrontSpec(KVROUTE)
        if kvroute_policies and policy not in kvroute_policies:
            raise FrontSpecError(
                f"--front {value!r}: kvroute policy {policy!r} is not one of "
                f"{', '.join(kvroute_policies)}"
            )
        return FrontSpec(KVROUTE, policy)
    if kind in PEER_POLICIES:
        policy = policy or PEER_DEFAULT_POLICY
        if (kind, policy) in _REFUSED:
            raise FrontSpecError(f"--front {value!r}: {policy} {_REFUSED[(kind, policy)]}")
        if policy not in PEER_POLICIES[kind]:
            raise FrontSpecError(
                f"--front {value!r}: {kind} policy {policy!r} is not one of "
                f"{', '.join(PEER_POLICIES[kind])}"
            )
        return FrontSpec(kind, policy)
    raise FrontSpecError(
        f"--front {value!r} is not one of kvroute[:POLICY], sglang-router[:POLICY], "
        "vllm-router[:POLICY] or http(s)://HOST:PORT"
    )


def expand_fronts(specs: Sequence[FrontSpec], policies: Sequence[str]) -> list[FrontSpec]:
    """A bare ``kvroute`` becomes one front per replay policy; duplicates are dropped."""
    out: list[FrontSpec] = []
    for spec in specs:
        expanded = (
            [FrontSpec(KVROUTE, p) for p in policies]
            if spec.kind == KVROUTE and spec.policy is None
            else [spec]
        )
        for s in expanded:
            if s not in out:
                out.append(s)
    return out


def peer_python(kind: str, peers_dir: Path = DEFAULT_PEERS_DIR) -> Path:
    """The python of a peer's virtualenv (``.peers/sglang/bin/python``)."""
    return Path(peers_dir) / PEER_VENVS[kind] / "bin" / "python"


def peer_command(
    spec: FrontSpec,
    *,
    port: int,
    metrics_port: int,
    worker_urls: Sequence[str],
    peers_dir: Path = DEFAULT_PEERS_DIR,
    kv_events: Sequence[KvEventSource] = (),
    block_size: int = 16,
    model: str = "",
) -> list[str]:
    """The argv that starts a peer router on 127.0.0.1:``port`` in front of ``worker_urls``;
    ``kv_events``, ``block_size`` and ``model``: what vllm-router's kv_aware reads.

    Raises :class:`FrontSpecError` when the peer's virtualenv is missing (it says how to
    make it).
    """
    if spec.kind not in PEER_MODULES or spec.policy is None:
        raise FrontSpecError(f"{spec.label} is not a peer router")
    python = peer_python(spec.kind, peers_dir)
    if not python.exists():
        raise FrontSpecError(
            f"{spec.kind} is not installed: {python} is missing; run "
            f"bench/peers/install_peers.sh (it makes the virtualenvs under {peers_dir})"
        )
    argv = [
        str(python),
        "-m",
        PEER_MODULES[spec.kind],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--policy",
        spec.policy,
        "--worker-urls",
        *worker_urls,
    ]
    if spec.kind == SGLANG_ROUTER:
        argv += ["--log-level", "warn"]
    else:
        # without this the router waits up to 30 s between worker start-up checks
        argv += ["--log-level", "warning", "--worker-startup-check-interval", "1"]
    for source in kv_events:
        argv += ["--kv-event-source", f"{source.worker_url}={source.pub}"]
        argv += ["--kv-event-replay-source", f"{source.worker_url}={source.replay}"]
    if kv_events:
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    return argv
