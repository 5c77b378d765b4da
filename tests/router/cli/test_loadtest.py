"""kvroute loadtest: config checks, prompts, the summary, and a short real run against
``kvroute up --executor sim`` (gRPC and the OpenAI HTTP front) with no error and no KV slot
left behind (bench.reliability_loadtest, the RELIABILITY.md figure's script)."""

from __future__ import annotations

import pytest

from bench import reliability_loadtest
from router.cli import loadtest
from router.cli.loadtest import LoadConfig, LoadReport, Prompts, Sample


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"concurrency": 0}, "--concurrency must be in 1..4096, got 0"),
        ({"duration_s": 0}, "--duration must be in"),
        ({"prompt_tokens": 0}, "--prompt-tokens must be >= 1"),
        ({"prompt_tokens": 4, "shared_prefix_tokens": 5}, "--shared-prefix-tokens must be in"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
        ({"timeout_s": float("nan")}, "--timeout must be > 0"),
    ],
)
def test_bad_settings_name_the_flag(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadConfig(**kw)


def test_cli_reports_bad_numbers_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert loadtest.main(["--router", "127.0.0.1:1", "--concurrency", "-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvroute loadtest: --concurrency must be in 1..4096, got -3"]


def test_prompts_share_prefixes_and_are_reproducible() -> None:
    config = LoadConfig(prompt_tokens=20, shared_prefix_tokens=8, prefix_groups=2, seed=3)
    a, b = Prompts(config), Prompts(config)
    first = [a.next() for _ in range(20)]
    assert first == [b.next() for _ in range(20)]
    assert all(len(p) == 20 and all(1 <= t <= 250 for t in p) for p in first)
    assert len({tuple(p[:8]) for p in first}) == 2 and len({tuple(p) for p in first}) == 20


def test_summary_counts_errors_and_percentiles() -> None:
    report = LoadReport(LoadConfig(), "x", wall_s=2.0)
    report.samples = [Sample("OK", 0.01 * i, 0.1 * i, 10) for i in range(1, 101)]
    report.samples += [Sample("UNAVAILABLE", None, 0.5, 0), Sample("HTTP 429", None, 0.1, 0)]
    s = report.summary()
    assert (s["requests"], s["ok"], s["errors"]) == (102, 100, {"HTTP 429": 1, "UNAVAILABLE": 1})
    assert s["requests_per_s"] == 50.0 and s["output_tokens_per_s"] == 500.0
    assert s["ttft_ms"] == {"p50": 510.0, "p90": 910.0, "p99": 1000.0, "max": 1000.0}
    assert s["e2e_ms"]["p50"] == 5100.0
    assert "errors: 1 HTTP 429, 1 UNAVAILABLE" in loadtest.format_summary(s)


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("http", [False, True], ids=["grpc", "http"])
def test_short_loadtest_against_kvroute_up(http: bool) -> None:
    result = reliability_loadtest.run(2, 16, 3.0, http=http)
    assert result["loadtest_exit"] == 0 and result["errors"] == {}, result
    assert result["ok"] > 16 and result["ttft_ms"]["p50"] > 0
    # every request generated its 32 tokens (ignore_eos), counted exactly on both fronts
    tokens = result["output_tokens_per_s"] * result["wall_s"]
    assert tokens == pytest.approx(32 * result["ok"], rel=0.01)
    assert result["workers_clean"], result["worker_kv"]
