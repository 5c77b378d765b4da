#!/usr/bin/env bash
# Everything the GPU worker measures, as one prepared command for a CUDA machine that has
# torch (and the triton that comes with its CUDA build) installed: a stage-by-stage probe of
# the machine, bench_gpu and the GPU-marked tests, each in its own process and bounded in
# time, every output under OUT_DIR and each step's tail printed as soon as it ends (a step
# that crashes, stalls or runs out of time leaves the others' figures; bench_gpu prints each
# step's median to stderr as it is measured).
#
#   bash bench/gpu_session.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR: wheels to install first (--no-deps, --no-index), for what the machine lacks
# (grpcio, protobuf, opentelemetry, ...: built for its Python). The project itself is
# installed editable without its dependencies, so the machine's torch is kept. On an image
# that has torch, triton, transformers, numpy and pytest for Python 3.12 (the H200 lent to
# this project), these were the missing ones, fetched on a machine with pip access:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d WHEEL_DIR grpcio==1.85.1 protobuf==7.35.1 \
#     grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 opentelemetry-api \
#     opentelemetry-sdk opentelemetry-semantic-conventions redis pytest-asyncio
# PYTHON: the interpreter (default: python, else python3, as found on PATH).
# PROBE_S / BENCH_S / TESTS_S / PROFILE_S: the time limits (seconds) of the probe, of each
# bench_gpu run (the graph-warmup one gets 60 s more), of the tests and of the profile. A
# step past its limit gets SIGTERM, then SIGKILL 5 s later, and the script goes on without
# waiting for it to exit (a process whose GPU kernel never ends may not exit at all), so the
# whole script ends within the sum of the limits plus ~30 s.
# Exit status: 0 when every step passed, else the first failing step's (124: a step ran out
# of time).
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_session.sh OUT_DIR [WHEEL_DIR]}
WHEELS=${2:-}
PROBE_S=${PROBE_S:-90}
BENCH_S=${BENCH_S:-120}
TESTS_S=${TESTS_S:-150}
PROFILE_S=${PROFILE_S:-60}
PY=${PYTHON:-$(command -v python || command -v python3)}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
status=0
export PYTHONUNBUFFERED=1

# bounded LIMIT FILE TAIL CMD...: CMD's output to FILE; at most LIMIT seconds; then FILE's
# last TAIL lines on stdout. Keeps the first failing step's exit status.
bounded() {
  local limit=$1 file=$2 lines=$3 rc=0 waited=0
  shift 3
  echo "== $(date -u +%T) $* (limit ${limit} s)"
  "$@" >"$file" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do
    sleep 1
    waited=$((waited + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    sleep 5
    kill -KILL "$pid" 2>/dev/null
    echo "step stopped at its ${limit} s limit (not waited for): $*" >>"$file"
    rc=124
  else
    wait "$pid"
    rc=$?
  fi
  tail -n "$lines" "$file"
  if [ "$rc" -ne 0 ]; then
    echo "step failed (exit $rc): $*"
    [ "$status" -ne 0 ] || status=$rc
  fi
}

if [ -n "$WHEELS" ]; then
  "$PY" -m pip install --quiet --no-deps --no-index "$WHEELS"/*.whl || exit 1
fi
"$PY" -m pip install --quiet --no-deps --no-index --no-build-isolation -e . || exit 1

date -u
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# 0. how far a fresh machine gets, stage by stage (torch, CUDA, Triton), with timings and
# the versions of torch, CUDA, Triton and transformers
bounded "$PROBE_S" "$OUT/probe.txt" 20 "$PY" -m bench.gpu_probe
# 1. issue 14's table: gather (the default) and paged (the Triton kernels) side by side
bounded "$BENCH_S" "$OUT/bench_gpu.txt" 40 \
  "$PY" -m bench.bench_gpu --attention gather,paged --json "$OUT/bench_gpu.json"
# 2. the GPU-marked tests: Triton kernels against their torch references on CUDA
# (test_paged_attention_triton.py), CUDA-graph decode captured and replayed against the eager
# static path and the regular one (test_decode_graph.py), the fused RMSNorm/RoPE kernels in
# bf16 and fp32 (test_fused_ops.py), logits parity with transformers' Llama on CUDA through
# every attention path (test_model_hf_parity.py), lone short prefills captured and replayed
# (test_prefill_graph.py)
bounded "$TESTS_S" "$OUT/pytest_gpu.txt" 25 \
  "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 120 tests/worker/engine
# 3. paged decode as CUDA graph replays (paged+graphs), and the fused RMSNorm/RoPE kernels
# (paged+fused: every step; paged+graphs+fused: decode and the lone cached prefill), every
# graph bucket captured first (--graph-warmup: how long and how much memory that takes)
bounded "$((BENCH_S + 60))" "$OUT/bench_gpu_graphs.txt" 40 \
  "$PY" -m bench.bench_gpu --attention paged --cuda-graphs --fused --graph-warmup \
  --json "$OUT/bench_gpu_graphs.json"
# 4. where the time goes: per step the kernel time and count, host time, top kernels and top
# Python functions (eager, and as graph replays)
bounded "$PROFILE_S" "$OUT/gpu_profile.txt" 60 \
  "$PY" -m bench.gpu_profile --json "$OUT/gpu_profile.json"
exit "$status"
