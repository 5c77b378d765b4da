"""bench_hash_key runs and reports both modes (speed itself is measured, not asserted)."""

from bench import bench_hash_key
from kvroute_proto import hashing


def test_one_round_reports_both_modes_and_leaves_the_process_unkeyed(tmp_path):
    out = tmp_path / "r.json"
    assert bench_hash_key.main(["--rounds", "1", "--json", str(out)]) == 0
    text = out.read_text()
    for name in ("hash_seq_s_2000_unkeyed", "hash_seq_s_8192_keyed", "slowdown_8192"):
        assert f'"{name}"' in text
    assert hashing.hash_key_fingerprint() == ""
