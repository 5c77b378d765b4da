"""``kvroute model init DIR``: a model directory the worker and the router both load, with a
real BPE tokenizer and a chat template, readable by all, its special tokens in config.json."""

from __future__ import annotations

import json
import stat

import kvroute_cli
from edge.tokenizer import load_tokenizer
from worker.engine.factory import build_executor
from worker.model_dir import BOS, EOS


def test_model_init_writes_a_directory_that_serves(tmp_path, capsys) -> None:
    out = tmp_path / "tiny-bpe"
    assert kvroute_cli.main(["model", "init", str(out)]) == 0
    assert f"--model {out}" in capsys.readouterr().out
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    for name in names:
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    tok = load_tokenizer(out)
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == tok.encode("")[0] == tok._tok.token_to_id(BOS)
    assert config["eos_token_id"] == tok._tok.token_to_id(EOS)
    # a real BPE: far fewer tokens than bytes; a chat template with the model's specials
    text = "The customer asked about the refund policy for the second order."
    assert len(tok.encode(text)) < len(text.encode()) // 2
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == f"{BOS}<|start|>user<|sep|>Hi<|end|><|start|>assistant<|sep|>"
    executor, served_tok = build_executor("torch", model_dir=out, num_kv_slots=64, device="cpu")
    assert executor.eos_token_ids == (config["eos_token_id"],)
    assert served_tok.encode(text) == tok.encode(text)
    # loaders that follow tokenizer.json's post-processor alone (transformers 5's generic
    # fast tokenizer, so vLLM) put the same bos first
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert plain.encode(text).ids == tok.encode(text)


def test_model_init_refuses_a_directory_with_files(tmp_path, capsys) -> None:
    (tmp_path / "x").write_text("mine")
    assert kvroute_cli.main(["model", "init", str(tmp_path)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["x"]
