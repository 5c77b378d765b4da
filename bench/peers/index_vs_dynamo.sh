#!/usr/bin/env bash
# bench_index's comparable section, alternating kvroute (dict index, vec index) and Dynamo's
# RadixTree in the same sitting, ROUNDS times; one JSON line per run on stdout.
#   python3 -m venv .peers/dynamo && .peers/dynamo/bin/pip install ai-dynamo-runtime==1.6.1
#   bash bench/peers/index_vs_dynamo.sh [ROUNDS]     (default 3; run from the repo root)
set -euo pipefail
ROUNDS=${1:-3}
PY=${PYTHON:-python}
DYN=${DYNAMO_PYTHON:-.peers/dynamo/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for backend in dict vec; do
    "$PY" -m bench.bench_index --comparable-only --backend "$backend" --json "$out/k.json" >/dev/null
    "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('meta'); print(json.dumps({'who': 'kvroute-$backend', 'round': $r, **{k: round(v) for k, v in d.items()}}))" "$out/k.json"
  done
  "$DYN" bench/peers/dynamo_index.py | "$PY" -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'who': 'dynamo', 'round': $r, **{k: round(v) for k, v in d.items()}}))"
done
