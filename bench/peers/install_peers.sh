#!/usr/bin/env bash
# Peer tools for the benchmarks, each in its own virtualenv under .peers/ (git-ignored):
# never dependencies of kvroute itself.
#
#   .peers/sglang   sglang-router==0.3.2   (SGLang's Rust gateway; --front sglang-router)
#   .peers/vllm     vllm-router==0.1.17    (vLLM's Rust router; --front vllm-router)
#   .peers/aiperf   aiperf                 (NVIDIA's benchmark client; bench/bench_aiperf.py)
#
# Usage: bench/peers/install_peers.sh [sglang] [vllm] [aiperf]   (default: all three)
# PEERS_DIR overrides the location; PYTHON the interpreter (python3.10+).
# AIPERF_VERSION pins aiperf (default: the newest that installs).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
peers_dir="${PEERS_DIR:-$repo_root/.peers}"
python="${PYTHON:-python3}"
aiperf_spec="aiperf${AIPERF_VERSION:+==$AIPERF_VERSION}"

declare -A spec=(
  [sglang]="sglang-router==0.3.2"
  [vllm]="vllm-router==0.1.17"
  [aiperf]="$aiperf_spec"
)

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(sglang vllm aiperf)
fi

mkdir -p "$peers_dir"
for name in "${targets[@]}"; do
  if [ -z "${spec[$name]+x}" ]; then
    echo "install_peers.sh: unknown peer '$name' (sglang, vllm or aiperf)" >&2
    exit 2
  fi
  venv="$peers_dir/$name"
  echo "== $name: ${spec[$name]} -> $venv"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "${spec[$name]}"
  "$venv/bin/python" -m pip show "${spec[$name]%%=*}" | sed -n 's/^Version: /   installed /p'
done
