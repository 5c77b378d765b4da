#!/usr/bin/env bash
# SGLang's RadixCache (sglang 0.5.23), CPU only, for bench_radix_cache's side-by-side run
# (bench/peers/sglang_radix.py). Its own virtualenv under .peers/ (git-ignored): never a
# dependency of kvroute.
#
#   bench/peers/install_sglang.sh
#   python -m bench.bench_radix_cache --peer-python .peers/sglang-radix/bin/python
#
# PEERS_DIR overrides .peers/; PYTHON the interpreter that makes the venv (python3.10+).
#
# sglang's own dependency list wants CUDA builds (torch 2.14 for CUDA, flashinfer, its
# kernels), so it is installed with --no-deps on top of the CPU torch wheel, followed by only
# the packages that `import sglang.srt.mem_cache.radix_cache` reaches (found by importing
# until it worked). torchvision is left out (its wheels want a CUDA torch): sglang_radix.py
# stubs it at import; the radix cache never calls it. pip then lists sglang's declared
# dependencies that are missing ("ERROR: pip's dependency resolver ..."): expected, harmless.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${PEERS_DIR:-$repo_root/.peers}/sglang-radix"
python="${PYTHON:-python3}"

mkdir -p "$(dirname "$venv")"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# Nothing installed later may replace the CPU torch with another build.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"

echo "== CPU torch"
"${pip[@]}" install --quiet torch==2.13.0
echo "== sglang 0.5.23 (no deps)"
"${pip[@]}" install --quiet --no-deps sglang==0.5.23
echo "== what the radix cache's import graph needs"
# Versions pinned where sglang 0.5.23 pins them.
"${pip[@]}" install --quiet -c "$constraints" \
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
  tqdm ipython aiohttp dill gguf triton \
  transformers==5.19.0 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0

echo "== check: the peer script imports SGLang's RadixCache"
"$venv/bin/python" -W ignore "$repo_root/bench/peers/sglang_radix.py" --help >/dev/null
"$venv/bin/python" -c 'import sglang, torch; print("   sglang", sglang.__version__, "torch", torch.__version__)'
echo "   $venv/bin/python"
