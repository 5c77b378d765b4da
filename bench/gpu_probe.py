"""What a fresh CUDA machine takes to get going, stage by stage, each line printed (and
flushed) as it completes: importing torch, initialising CUDA, a bf16 matrix product,
allocating and freeing a large buffer, importing Triton and compiling and running one small
kernel, importing transformers; the stage lines name the versions found. The first step of
``bench/gpu_session.sh``: when a later step stalls, this says whether the machine itself
gets that far, and how long each stage took.

    python -m bench.gpu_probe
"""

from __future__ import annotations

import sys
import time

T0 = time.perf_counter()


def stage(message: str) -> None:
    print(f"[gpu_probe +{time.perf_counter() - T0:7.2f} s] {message}", flush=True)


def main() -> int:
    stage("start")
    import torch

    stage(f"torch {torch.__version__} imported (cuda {torch.version.cuda})")
    if not torch.cuda.is_available():
        stage("CUDA is not available")
        return 1
    torch.cuda.init()
    dev = torch.device("cuda")
    stage(f"CUDA initialised: {torch.cuda.get_device_name(dev)}")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    (a @ a).sum().item()
    stage("bf16 matrix product done")
    big = torch.empty(8 * 2**30, dtype=torch.uint8, device=dev)
    big.fill_(1)
    torch.cuda.synchronize()
    del big
    stage("8 GiB allocated, filled and freed")
    pinned = torch.zeros(1 << 20, dtype=torch.int64, pin_memory=True)
    pinned.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    stage("pinned host buffer copied to the device")
    import triton
    import triton.language as tl

    stage(f"triton {triton.__version__} imported")

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.zeros(1000, device=dev)
    _add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
    torch.cuda.synchronize()
    stage(f"a Triton kernel compiled and ran: {'ok' if bool((x == 1).all()) else 'WRONG'}")
    import transformers  # the HF parity tests' reference

    stage(f"transformers {transformers.__version__} imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
