"""What the bridge knows of its engine: the model it serves and its load.

The model comes from ``/v1/models`` (its name, ``max_model_len``); the load from the
engine's Prometheus ``/metrics`` when it serves vLLM's names (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``),
read every load interval. An engine without them still works: the load is then what the
bridge forwarded itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import LoadReport
from kvroute_proto.hashing import hash_key_fingerprint
from worker.bridge.service.engine_http import EngineHttp

log = logging.getLogger("kvroute.bridge.engine")

EXECUTOR = "bridge"  # WorkerInfo.executor of a bridge


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own counts (vLLM's /metrics), summed over its label sets."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    kv_total_tokens: int = 0


_VLLM_LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def metric_lines(text: str, names: tuple[str, ...]) -> str:
    """The lines of a ``/metrics`` page that begin with one of ``names`` (samples and their
    ``# TYPE``), the part the load parsers read. A vLLM page runs to hundreds of histogram
    lines; parsing all of it held the event loop for milliseconds at each poll, and the
    tokens the bridge relays waited meanwhile (decision 0038)."""
    kept = [
        line
        for line in text.splitlines()
        if line.startswith(names) or (line.startswith("# TYPE ") and line[7:].startswith(names))
    ]
    return "\n".join(kept) + "\n"


def parse_vllm_metrics(text: str) -> EngineLoad | None:
    """The load in a vLLM ``/metrics`` page; None when it has none of vLLM's names."""
    values: dict[str, float] = {}
    total = 0
    found = False
    page = metric_lines(text, ("vllm:cache_config_info", *_VLLM_LOAD))
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                blocks = int(float(sample.labels.get("num_gpu_blocks") or 0))
                total += blocks * int(float(sample.labels.get("block_size") or 0))
                found = True
            elif name in _VLLM_LOAD:
                values[name] = values.get(name, 0.0) + sample.value
                found = True
    if not found:
        return None
    return EngineLoad(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=min(max(values.get("vllm:kv_cache_usage_perc", 0.0), 0.0), 1.0),
        kv_total_tokens=total,
    )


class EngineState:
    """The engine's identity and last load reading, for GetLoad and the load reports."""

    def __init__(
        self,
        engine: EngineHttp,
        worker_id: str,
        block_size: int,
        *,
        max_running_requests: int = 0,
        parse_metrics: Callable[[str], EngineLoad | None] | None = None,
    ) -> None:
        self.engine = engine
        self.parse_metrics = parse_metrics or parse_vllm_metrics
        self.worker_id = worker_id
        self.block_size = block_size
        self.model_name = ""
        self.max_model_len = 0
        self.max_running_requests = max_running_requests
        self.load: EngineLoad | None = None
        self.last_error = "not asked yet"
        self.engine_up = False

    async def ensure_model(self) -> bool:
        """Ask ``/v1/models`` until it answers once; True when the model is known."""
        if self.model_name:
            return True
        try:
            model = await self.engine.model()
        except Exception as exc:  # any failure means "not up yet"
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        self.model_name = model.name
        self.max_model_len = model.max_model_len
        self.engine_up = True
        log.info(
            "engine at %s serves %r (max_model_len %d)",
            self.engine.base_url,
            self.model_name,
            self.max_model_len,
        )
        return True

    async def poll(self) -> None:
        """Read the engine's /metrics (and its model, until known); never raises."""
        await self.ensure_model()
        try:
            text = await self.engine.get_text("/metrics")
        except Exception as exc:
            self.engine_up = False
            self.last_error = f"{type(exc).__name__}: {exc}"
            return
        self.engine_up = True
        try:
            self.load = self.parse_metrics(text)
        except ValueError as exc:
            self.load = None
            self.last_error = f"unreadable /metrics: {exc}"

    def load_report(self, started: int, waiting: int, queued_prefill: int) -> LoadReport:
        """The engine's load with the bridge's own counts of what it forwarded."""
        load = self.load or EngineLoad()
        total = load.kv_total_tokens
        return LoadReport(
            num_running=max(load.running, started),
            num_waiting=max(load.waiting, waiting),
            num_queued_prefill_tokens=queued_prefill,
            num_free_kv_tokens=int(total * (1.0 - load.kv_usage)),
            num_total_kv_tokens=total,
        )

    def worker_info(
        self, epoch: int, started: int, waiting: int, queued_prefill: int
    ) -> pb.WorkerInfo:
        load = self.load_report(started, waiting, queued_prefill)
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            epoch=epoch,
            block_size=self.block_size,
            page_size=self.block_size,
            kv_capacity_tokens=load.num_total_kv_tokens,
            max_context_tokens=self.max_model_len,
            executor=EXECUTOR,
            load=codec.load_to_pb(load),
            model_name=self.model_name,
            tokenizer_fingerprint="",  # the bridge has no tokenizer: routers without --model
            hash_key_fingerprint=hash_key_fingerprint(),
            max_running_requests=self.max_running_requests,
        )
