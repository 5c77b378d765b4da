"""Loading a local HF Llama directory: the happy path and every ModelLoadError."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.engine.factory import build_tiny_default
from worker.engine.loader import load_model, save_hf
from worker.engine.model import LlamaForCausalLM, build_tiny_model, tiny_config
from worker.engine.tokenizer import ByteTokenizer, HFTokenizer
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams
from worker.errors import ModelLoadError


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_default(seed=0)


@pytest.fixture
def model_dir(tmp_path, model) -> Path:
    return save_hf(model, tmp_path / "m")


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def edit_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def first_token(model: LlamaForCausalLM, ids: list[int]) -> int:
    ex = TorchExecutor.create(model, 64)
    item = ForwardItem("r", np.array(ids), 0, np.arange(len(ids)), SamplingParams())
    return ex.forward([item], [])[0]


def test_save_writes_hf_names_and_config(model_dir, model):
    names = set(load_file(str(model_dir / "model.safetensors")))
    assert names == set(model.state_dict())
    assert {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    } <= names
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["model_type"] == "llama"
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["eos_token_id"] == ByteTokenizer.EOS


def test_load_round_trips_weights_config_and_byte_tokenizer(model_dir, model):
    loaded = load_model(model_dir)
    assert loaded.model.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert first_token(loaded.model, [1, 2, 3]) == first_token(model, [1, 2, 3])


def test_load_uses_tokenizer_json_when_present(model_dir):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    loaded = load_model(model_dir)
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.encode("hello world") == [1, 2]
    assert loaded.tokenizer.eos_token_id == ByteTokenizer.EOS  # from config.json


def test_eos_list_and_llama3_rope_scaling_are_read(model_dir):
    edit_config(
        model_dir,
        eos_token_id=[258, 259],
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    cfg = load_model(model_dir).model.config
    assert cfg.eos_token_ids == (258, 259)
    assert cfg.eos_token_id == 258
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0


def test_generation_config_eos_ids_join_config_json(model_dir):
    # Llama-3-8B-Instruct as released: config.json names <|end_of_text|> alone, and
    # generation_config.json adds <|eot_id|>, the id a chat turn actually ends with.
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 258]}))
    loaded = load_model(model_dir)
    assert loaded.model.config.eos_token_ids == (258, 259)  # config.json's first, no repeats
    ex = TorchExecutor.create(loaded.model, 8)
    assert (ex.eos_token_id, ex.eos_token_ids) == (258, (258, 259))
    assert loaded.tokenizer.eos_token_id == 258


def test_save_writes_several_eos_ids_as_a_list(tmp_path):
    model = build_tiny_model(0, config=tiny_config(eos_token_ids=(258, 259)))
    model_dir = save_hf(model, tmp_path / "m")
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == [258, 259]
    assert load_model(model_dir).model.config == model.config


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: missing config\.json"):
        load_model(model_dir)


def test_malformed_config_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "gpt2"}, "key 'model_type' is 'gpt2'"),
        ({"hidden_size": None}, "missing key 'hidden_size'"),
        ({"num_hidden_layers": "two"}, "key 'num_hidden_layers' must be an integer"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"eos_token_id": "x"}, "key 'eos_token_id'"),
        ({"eos_token_id": [1, -1]}, "key 'eos_token_id'"),
        ({"eos_token_id": True}, "key 'eos_token_id'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope_type' 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "key 'rope_scaling' is malformed"),
    ],
)
def test_bad_config_keys(model_dir, changes, match):
    edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(model_dir)


def test_no_weight_files(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(model_dir)


def test_corrupt_weight_file(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors"):
        load_model(model_dir)


def test_missing_weight_key(model_dir):
    edit_weights(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing key 'model\.layers\.1\.self_attn\.k_proj"):
        load_model(model_dir)


def test_unexpected_weight_key(model_dir):
    edit_weights(model_dir, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match=r"unexpected key 'model\.extra\.weight'"):
        load_model(model_dir)


def test_wrong_weight_shape(model_dir):
    edit_weights(model_dir, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \(7,\)"):
        load_model(model_dir)


def test_rotary_inv_freq_buffers_are_ignored(model_dir):
    edit_weights(
        model_dir,
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
    )
    load_model(model_dir)


def test_vocab_too_small_for_byte_tokenizer(model_dir):
    edit_config(model_dir, vocab_size=100)
    edit_weights(
        model_dir,
        lambda t: t.update(
            {
                "model.embed_tokens.weight": t["model.embed_tokens.weight"][:100].clone(),
                "lm_head.weight": t["lm_head.weight"][:100].clone(),
            }
        ),
    )
    with pytest.raises(ModelLoadError, match="byte tokenizer needs vocab_size >= 260"):
        load_model(model_dir)


def test_sharded_checkpoint_loads(model_dir, model):
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    keys = sorted(tensors)
    half = len(keys) // 2
    save_file({k: tensors[k] for k in keys[:half]}, str(model_dir / "model-1-of-2.safetensors"))
    save_file({k: tensors[k] for k in keys[half:]}, str(model_dir / "model-2-of-2.safetensors"))
    loaded = load_model(model_dir)
    assert first_token(loaded.model, [5, 6]) == first_token(model, [5, 6])


def test_eos_falls_back_to_generation_config(model_dir):
    edit_config(model_dir, eos_token_id=None)
    assert load_model(model_dir).model.config.eos_token_ids == ()
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_model(model_dir).model.config.eos_token_id == 7
    (model_dir / "generation_config.json").write_text("[oops")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: not valid JSON"):
        load_model(model_dir)
