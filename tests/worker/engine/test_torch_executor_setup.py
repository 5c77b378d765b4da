"""KV pool storage and sizing, and the executor factory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from worker.engine.factory import build_executor
from worker.engine.kv_pool import (
    KVPool,
    KVPoolConfig,
    bytes_per_slot,
    cuda_slots_for_memory_fraction,
    slots_for_memory,
)
from worker.engine.loader import save_hf
from worker.engine.model import build_tiny_model, tiny_config
from worker.engine.tokenizer import ByteTokenizer
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams
from worker.errors import ModelLoadError


def test_pool_shapes_and_slot_addressing():
    pool = KVPool(KVPoolConfig(num_slots=10, num_layers=3, num_kv_heads=2, head_dim=4))
    assert len(pool.k) == len(pool.v) == 3
    assert pool.k[0].shape == (10, 2, 4)
    assert pool.nbytes == 10 * 2 * 3 * 2 * 4 * 4
    k = torch.arange(16.0).view(2, 2, 4)
    with torch.inference_mode():
        pool.write(1, torch.tensor([7, 2]), k, -k)
        got_k, got_v = pool.gather(1, torch.tensor([[2, 7], [7, 7]]))
    assert torch.equal(got_k[0, 0], k[1]) and torch.equal(got_k[0, 1], k[0])
    assert torch.equal(got_v[1, 1], -k[0])
    assert torch.count_nonzero(pool.k[0]) == 0  # other layers untouched


def test_pool_config_rejects_empty_dimensions():
    with pytest.raises(ValueError, match=r"KVPoolConfig\.num_slots must be >= 1, got 0"):
        KVPoolConfig(num_slots=0, num_layers=1, num_kv_heads=1, head_dim=2)


def test_slot_sizing_from_memory():
    per_slot = bytes_per_slot(32, 8, 128, torch.bfloat16)
    assert per_slot == 128 * 1024  # Llama-3-8B: 128 KiB of KV per token
    assert slots_for_memory(80 * 2**30, 0.5, per_slot) == 40 * 2**30 // per_slot
    with pytest.raises(ValueError, match=r"memory fraction must be in \(0, 1\]"):
        slots_for_memory(100, 1.5, 10)


def test_cuda_sizing_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cuda_slots_for_memory_fraction(
            0.5, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu"
        )


def test_executor_rejects_pool_of_another_shape():
    model = build_tiny_model(0)
    pool = KVPool(KVPoolConfig(num_slots=4, num_layers=1, num_kv_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="does not match the model"):
        TorchExecutor(model, pool, "cpu")


def test_build_torch_default_is_tiny_model_with_byte_tokenizer():
    ex, tok = build_executor("torch", num_kv_slots=32, device="cpu", seed=0)
    assert isinstance(tok, ByteTokenizer)
    assert (ex.vocab_size, ex.max_context_tokens, ex.eos_token_id) == (512, 4096, 258)
    assert ex.num_kv_slots == 32
    assert ex.vocab_size >= tok.vocab_size
    ids = np.array(tok.encode("hi"))
    item = ForwardItem("r", ids, 0, np.arange(2), SamplingParams())
    again, _ = build_executor("torch", num_kv_slots=32, device="cpu", seed=0)
    assert ex.forward([item], []) == again.forward([item], [])  # fixed weights per seed


def test_build_torch_from_model_dir(tmp_path):
    save_hf(build_tiny_model(5, config=tiny_config(eos_token_id=258)), tmp_path)
    ex, tok = build_executor("torch", model_dir=tmp_path, num_kv_slots=16, device="cpu")
    assert isinstance(tok, ByteTokenizer)
    assert ex.eos_token_id == 258


def test_torch_executor_reports_every_eos_id():
    # Llama-3-Instruct lists <|end_of_text|> and <|eot_id|>; the scheduler needs both.
    cfg = tiny_config(eos_token_ids=(258, 259))
    ex = TorchExecutor.create(build_tiny_model(0, config=cfg), 8)
    assert (ex.eos_token_id, ex.eos_token_ids) == (258, (258, 259))
    none = TorchExecutor.create(build_tiny_model(0, config=tiny_config()), 8)
    assert (none.eos_token_id, none.eos_token_ids) == (None, ())
    with pytest.raises(ValueError, match="eos_token_id or eos_token_ids"):
        tiny_config(eos_token_id=258, eos_token_ids=(259,))


def test_build_torch_from_model_dir_keeps_every_eos_id(tmp_path):
    save_hf(build_tiny_model(5, config=tiny_config(eos_token_ids=(258, 259))), tmp_path)
    ex, _ = build_executor("torch", model_dir=tmp_path, num_kv_slots=16, device="cpu")
    assert (ex.eos_token_id, ex.eos_token_ids) == (258, (258, 259))


def test_build_torch_bad_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        build_executor("torch", model_dir=tmp_path / "missing", num_kv_slots=16)


def test_build_sim_pairs_byte_tokenizer_vocab():
    ex, tok = build_executor("sim", num_kv_slots=16)
    assert ex.vocab_size == tok.vocab_size
    assert ex.eos_token_id == tok.eos_token_id
    assert ex.eos_token_ids == (tok.eos_token_id,)
    assert ex.max_context_tokens == 8192


def test_build_sim_with_a_longer_context():
    ex, _ = build_executor("sim", num_kv_slots=16, sim_max_context_tokens=200_000)
    assert ex.max_context_tokens == 200_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "jax", "num_kv_slots": 1}, "executor kind must be one of"),
        ({"kind": "torch", "num_kv_slots": 0}, "num_kv_slots must be >= 1"),
        ({"kind": "sim", "num_kv_slots": 1, "model_dir": "x"}, "model_dir"),
        ({"kind": "torch", "num_kv_slots": 1, "kv_memory_fraction": 0.0}, "kv_memory_fraction"),
        ({"kind": "torch", "num_kv_slots": 1, "sim_max_context_tokens": 8}, "only the 'sim'"),
    ],
)
def test_build_rejects_bad_arguments(kwargs, match):
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError, match=match):
        build_executor(kind, **kwargs)


def test_sim_factory_does_not_import_torch():
    code = (
        "import sys; from worker.engine.factory import build_executor; "
        "build_executor('sim', num_kv_slots=8); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_torch_with_an_attention_backend():
    """``kvroute worker --attention``: the executor attends as asked; the CLI's choices are
    paged_attention's; the sim executor refuses the option; on the CPU the Triton kernels
    are refused unless interpreted."""
    from worker import cli
    from worker.engine import paged_attention

    assert cli.ATTENTION_CHOICES == paged_attention.ATTENTION_CHOICES
    ex, _ = build_executor("torch", num_kv_slots=32, device="cpu", attention="paged-torch")
    assert ex.attention == "paged-torch"
    default, _ = build_executor("torch", num_kv_slots=32, device="cpu")
    assert default.attention == "gather"
    with pytest.raises(ValueError, match="attention: only the 'torch' executor"):
        build_executor("sim", num_kv_slots=16, attention="paged")
    args = cli.build_parser().parse_args(["--executor", "torch", "--attention", "paged"])
    assert args.attention == "paged"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--attention", "flash"])
