#!/usr/bin/env bash
# Everything the GPU worker measures, as one prepared command for a CUDA machine that has
# torch (and the triton that comes with its CUDA build) installed: the GPU-marked tests and
# bench_gpu, each bounded in time, every output written under OUT_DIR.
#
#   bash bench/gpu_session.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR: wheels to install first (--no-deps, --no-index), for what the machine lacks
# (grpcio, protobuf, opentelemetry, ...: built for its Python). The project itself is
# installed editable without its dependencies, so the machine's torch is kept.
# Exit status: 0 when both steps passed, else the first failing step's.
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_session.sh OUT_DIR [WHEEL_DIR]}
WHEELS=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
status=0
step() {  # run a step; keep the first failing step's exit status
  "$@" || { local rc=$?; [ "$status" -ne 0 ] || status=$rc; }
}

if [ -n "$WHEELS" ]; then
  python -m pip install --quiet --no-deps --no-index "$WHEELS"/*.whl || exit 1
fi
python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
} >"$OUT/machine.txt" 2>&1

# the GPU-marked tests (Triton kernels against their torch references on CUDA; CUDA-graph
# decode captured and replayed against the eager static path and the regular one,
# tests/worker/engine/test_decode_graph.py; the fused RMSNorm/RoPE kernels in bf16 and fp32,
# tests/worker/engine/test_fused_ops.py)
step timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/worker/engine \
  >"$OUT/pytest_gpu.txt" 2>&1
# decode at batch 1/8/32/128 and both prefills, gather and paged side by side, paged's
# decode steps again as CUDA graph replays (column paged+graphs), and both paged columns
# with the fused RMSNorm/RoPE kernels (paged+fused: every step; paged+graphs+fused: decode)
step timeout 300 python -m bench.bench_gpu --cuda-graphs --fused --json "$OUT/bench_gpu.json" \
  >"$OUT/bench_gpu.txt" 2>&1

tail -5 "$OUT/pytest_gpu.txt"
tail -45 "$OUT/bench_gpu.txt"
exit "$status"
