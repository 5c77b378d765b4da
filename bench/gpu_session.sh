#!/usr/bin/env bash
# Everything the GPU worker measures, as one prepared command for a CUDA machine that has
# torch (and the triton that comes with its CUDA build) installed: bench_gpu and the
# GPU-marked tests, each in its own process and bounded in time, every output under OUT_DIR
# (a step that crashes or runs out of time leaves the others' figures; bench_gpu prints each
# step's median to stderr as it is measured).
#
#   bash bench/gpu_session.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR: wheels to install first (--no-deps, --no-index), for what the machine lacks
# (grpcio, protobuf, opentelemetry, ...: built for its Python). The project itself is
# installed editable without its dependencies, so the machine's torch is kept.
# BENCH_S / TESTS_S: the time limits (seconds) of each bench_gpu run and of the tests; a step
# still alive 10 s after its limit is killed (a process waiting on a hung GPU kernel may not
# act on SIGTERM).
# Exit status: 0 when every step passed, else the first failing step's.
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_session.sh OUT_DIR [WHEEL_DIR]}
WHEELS=${2:-}
BENCH_S=${BENCH_S:-120}
TESTS_S=${TESTS_S:-150}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
status=0
step() {  # run a step; keep the first failing step's exit status
  "$@" || { local rc=$?; echo "step failed (exit $rc): $*"; [ "$status" -ne 0 ] || status=$rc; }
}
export PYTHONUNBUFFERED=1

if [ -n "$WHEELS" ]; then
  python -m pip install --quiet --no-deps --no-index "$WHEELS"/*.whl || exit 1
fi
python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  python -c "import transformers; print('transformers', transformers.__version__)"
} >"$OUT/machine.txt" 2>&1

# 0. how far a fresh machine gets, stage by stage (torch, CUDA, Triton), with timings
step timeout -k 10 90 python -m bench.gpu_probe >"$OUT/probe.txt" 2>&1
cat "$OUT/probe.txt"
# 1. issue 14's table: gather (the default) and paged (the Triton kernels) side by side
step timeout -k 10 "$BENCH_S" python -m bench.bench_gpu --attention gather,paged \
  --json "$OUT/bench_gpu.json" >"$OUT/bench_gpu.txt" 2>&1
# 2. the GPU-marked tests: Triton kernels against their torch references on CUDA
# (test_paged_attention_triton.py), CUDA-graph decode captured and replayed against the eager
# static path and the regular one (test_decode_graph.py), the fused RMSNorm/RoPE kernels in
# bf16 and fp32 (test_fused_ops.py), logits parity with transformers' Llama on CUDA through
# every attention path (test_model_hf_parity.py)
step timeout -k 10 "$TESTS_S" python -m pytest -m gpu -q -p no:cacheprovider --timeout 120 \
  tests/worker/engine >"$OUT/pytest_gpu.txt" 2>&1
# 3. paged decode as CUDA graph replays (paged+graphs), and the fused RMSNorm/RoPE kernels
# (paged+fused: every step; paged+graphs+fused: decode)
step timeout -k 10 "$BENCH_S" python -m bench.bench_gpu --attention paged --cuda-graphs --fused \
  --json "$OUT/bench_gpu_graphs.json" >"$OUT/bench_gpu_graphs.txt" 2>&1

tail -30 "$OUT/bench_gpu.txt"
tail -15 "$OUT/pytest_gpu.txt"
tail -30 "$OUT/bench_gpu_graphs.txt"
exit "$status"
