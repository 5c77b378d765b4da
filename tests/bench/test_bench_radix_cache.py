"""The radix cache benchmark runs (--quick) and writes exactly the documented JSON keys."""

import json

from bench import bench_radix_cache


def test_quick_run_writes_the_documented_keys(tmp_path, capsys):
    out = tmp_path / "radix.json"
    assert bench_radix_cache.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {
        "insert_seq_s",
        "match_full_q_s",
        "match_split_q_s",
        "insert_events_seq_s",
        "evict_us_per_node_10k",
        "evict_us_per_node_100k",
        "evict_us_per_node_1000k",
    }
    assert all(isinstance(v, float) and v > 0 for v in result.values())
    assert "insert_seq_s" in capsys.readouterr().out
