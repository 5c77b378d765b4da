#!/usr/bin/env bash
# The side-by-side of BENCHMARKS.md ("kvroute's router next to sglang-router and vllm-router"):
# the same 4-worker sim fleet (real worker processes with their HTTP API, on loopback) behind
# each front end in turn, back to back, on the support-agent workload and the Mooncake sample.
#
#   bench/peers/install_peers.sh sglang vllm     # once
#   bench/peers/side_by_side.sh                  # ~20 min on 2 cores; JSON under $OUT
#
# LIMIT_SA / LIMIT_MC: requests replayed (default 600 / 300); SPEEDUP (default 1: the 2-core
# box does not keep up with the compressed trace beyond that; Python overhead is not
# compressed); PEERS_DIR: the peers' virtualenvs (default .peers); PYTHON (default python).
# Per-request results (worker, cached tokens, TTFT, e2e) land in $OUT/requests-*/.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-out/side_by_side}"
speedup="${SPEEDUP:-1}"
python="${PYTHON:-python}"
peers=(--peers-dir "${PEERS_DIR:-.peers}")
mkdir -p "$out"

fronts=(
  --front kvroute:cache_aware
  --front sglang-router:cache_aware
  --front vllm-router:cache_aware
  --front vllm-router:power_of_two
  --front vllm-router:consistent_hash
  --front kvroute:round_robin
  --front sglang-router:round_robin
)

"$python" -m kvroute_cli workload support-agent -o "$out/sa.jsonl"
"$python" -m kvroute_cli replay --trace "$out/sa.jsonl" --trace-block-size 16 --mode live \
  --workers 4 --limit "${LIMIT_SA:-600}" --speedup "$speedup" "${fronts[@]}" "${peers[@]}" \
  --requests-dir "$out/requests-sa4" --json "$out/sa4.json"
"$python" -m kvroute_cli replay --trace bench/data/mooncake_sample.jsonl --mode live \
  --workers 4 --limit "${LIMIT_MC:-300}" --speedup "$speedup" "${fronts[@]}" "${peers[@]}" \
  --requests-dir "$out/requests-mc4" --json "$out/mc4.json"
