#!/usr/bin/env bash
# bench_index's comparable section, alternating kvroute's index backends (BACKENDS, default
# "numba dict": the router's default and the pure-Python reference; "vec" is the numpy one)
# and Dynamo's RadixTree in the same sitting, ROUNDS times; one JSON line per run on stdout.
#   bash bench/peers/index_vs_dynamo.sh [ROUNDS]     (default 3; run from the repo root,
#                                                     in kvroute's virtualenv)
# Dynamo's runtime goes in its own virtualenv, created on first use (the project never
# imports it): python3 -m venv .peers/dynamo && .peers/dynamo/bin/pip install
# ai-dynamo-runtime==1.6.1. DYNAMO_PYTHON overrides the interpreter.
set -euo pipefail
ROUNDS=${1:-3}
PY=${PYTHON:-python}
DYN=${DYNAMO_PYTHON:-.peers/dynamo/bin/python}
if [ -z "${DYNAMO_PYTHON:-}" ] && ! "$DYN" -c "import dynamo._core" 2>/dev/null; then
  echo "installing ai-dynamo-runtime==1.6.1 into .peers/dynamo" >&2
  python3 -m venv .peers/dynamo
  .peers/dynamo/bin/pip install -q ai-dynamo-runtime==1.6.1 >&2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for backend in ${BACKENDS:-numba dict}; do
    "$PY" -m bench.bench_index --comparable-only --backend "$backend" --json "$out/k.json" >/dev/null
    "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('meta'); print(json.dumps({'who': 'kvroute-$backend', 'round': $r, **{k: round(v) for k, v in d.items()}}))" "$out/k.json"
  done
  "$DYN" bench/peers/dynamo_index.py | "$PY" -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'who': 'dynamo', 'round': $r, **{k: round(v) for k, v in d.items()}}))"
done
