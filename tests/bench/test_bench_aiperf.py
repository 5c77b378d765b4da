"""bench_aiperf's pieces that run without aiperf: the byte tokenizer, trace scaling, summary."""

from __future__ import annotations

import json
import math

import pytest

from bench.bench_aiperf import (
    TOKENIZER_REPO,
    aiperf_command,
    build_parser,
    main,
    scaled_records,
    summarize_aiperf,
    write_byte_tokenizer,
    write_tokenizer_cache,
)
from fleetsim.replay.trace import TraceRecord
from worker.engine.tokenizer import ByteTokenizer


def test_the_byte_tokenizer_gives_the_sim_workers_ids(tmp_path):
    from tokenizers import Tokenizer

    directory = write_byte_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    for text in ["Shall I compare thee to a summer's day?\n", "  two  spaces", "naïve €", "<s>"]:
        ids = tok.encode(text, add_special_tokens=True).ids
        assert ids == ByteTokenizer().encode(text)  # one id per UTF-8 byte, nothing added
        assert tok.decode(ids) == text
    assert tok.get_vocab_size() == ByteTokenizer().vocab_size == 260
    assert tok.token_to_id("</s>") == ByteTokenizer.EOS


def test_the_tokenizer_cache_entry_has_the_hub_layout(tmp_path):
    write_tokenizer_cache(tmp_path)
    repo = tmp_path / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = (repo / "refs" / "main").read_text()
    assert (repo / "snapshots" / snapshot / "tokenizer.json").is_file()


def test_scaled_records_start_at_zero_and_compress_gaps():
    records = [TraceRecord(t, 10, 1, (1,)) for t in (1000.0, 1500.0, 3004.0)]
    scaled = scaled_records(records, 4.0)
    assert [r.timestamp_ms for r in scaled] == [0.0, 125.0, 501.0]
    assert [r.hash_ids for r in scaled] == [(1,)] * 3
    with pytest.raises(ValueError, match="--speedup must be > 0, got 0"):
        scaled_records(records, 0)


def test_summary_reads_aiperf_export():
    export = {
        "request_count": {"avg": 20},
        "error_request_count": {"avg": 2},
        "time_to_first_token": {"p50": 6.0, "p99": 16.0, "avg": 8.0},
        "request_latency": {"p50": 450.0, "p99": 780.0},
        "overall_usage_prompt_cache_read_pct": {"avg": 41.5},
        "input_sequence_length": {"avg": 13000.0},
    }
    s = summarize_aiperf(export, speedup=10.0)
    assert (s["requests"], s["errors"], s["ttft_p50_ms"], s["ttft_p99_ms"]) == (20, 2, 6.0, 16.0)
    assert s["cache_hit_pct"] == 41.5 and s["latency_p99_ms"] == 780.0
    assert math.isnan(s["osl_avg"])  # absent: NaN, not a made-up zero
    assert summarize_aiperf({}, 1.0)["errors"] == 0.0


def test_aiperf_command_replays_the_trace_on_its_schedule(tmp_path):
    args = build_parser().parse_args(["--trace", "t.jsonl", "--trace-block-size", "16"])
    cmd = aiperf_command(args, "http://127.0.0.1:1", "m", tmp_path / "t.jsonl", tmp_path / "o")
    assert cmd[cmd.index("--custom-dataset-type") + 1] == "mooncake_trace"
    assert "--fixed-schedule" in cmd and "--streaming" in cmd
    assert cmd[cmd.index("--prompt-input-tokens-block-size") + 1] == "16"
    assert cmd[cmd.index("--tokenizer") + 1] == TOKENIZER_REPO
    assert cmd[cmd.index("--endpoint-type") + 1] == "completions"


def test_missing_aiperf_says_how_to_install_it(tmp_path, capsys):
    argv = ["--trace", "x.jsonl", "--aiperf", str(tmp_path / "nope")]
    assert main(argv) == 2
    assert "install_peers.sh aiperf" in capsys.readouterr().err
