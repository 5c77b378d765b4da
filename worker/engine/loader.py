"""Load a local Hugging Face Llama-format checkpoint (``--model DIR``), and write one.

A model directory holds ``config.json``, one or more ``*.safetensors`` files and,
optionally, ``tokenizer.json`` and ``tokenizer_config.json`` (read by the shared
:mod:`edge.tokenizer`, as the router reads them; without tokenizer.json the byte
tokenizer is used if the model's vocab covers it) and ``generation_config.json`` (its
``eos_token_id`` ids join config.json's).
Nothing is fetched from the network. Every failure is a ``ModelLoadError`` that names the
file and, where there is one, the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    TokenizerLoadError,
    eos_ids_from_value,
    load_tokenizer_or_bytes,
    model_eos_token_ids,
)
from worker.engine.model import LlamaConfig, LlamaForCausalLM, RopeScaling
from worker.errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SUPPORTED_MODEL_TYPES = ("llama",)
# Non-persistent buffers some exporters still write; derived from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer


def _require(raw: dict[str, Any], key: str, path: Path, kind: type) -> Any:
    if key not in raw:
        raise ModelLoadError(f"{path}: missing key {key!r}")
    value = raw[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelLoadError(f"{path}: key {key!r} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ModelLoadError(f"{path}: key {key!r} must be a number, got {value!r}")
    return value


def _optional(raw: dict[str, Any], key: str, path: Path, kind: type, default: Any) -> Any:
    if raw.get(key) is None:
        return default
    value = _require(raw, key, path, kind)
    return float(value) if kind is float else value


def _eos_ids(value: Any, path: Path) -> tuple[int, ...]:
    """The ``eos_token_id`` value (None, an id or a list of ids) as unique ids, in order."""
    try:
        return eos_ids_from_value(value, str(path))
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc


def _rope_scaling(raw: dict[str, Any], path: Path) -> RopeScaling | None:
    # transformers >= 5 writes "rope_parameters" (rope_theta and the scaling together).
    value = raw.get("rope_scaling") or raw.get("rope_parameters")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: key 'rope_scaling' must be an object or null")
    kind = value.get("rope_type", value.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(
            f"{path}: key 'rope_scaling.rope_type' {kind!r} is not supported (only 'llama3')"
        )
    try:
        return RopeScaling(
            factor=float(value["factor"]),
            low_freq_factor=float(value["low_freq_factor"]),
            high_freq_factor=float(value["high_freq_factor"]),
            original_max_position_embeddings=int(value["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: key 'rope_scaling' is malformed: {exc!r}") from exc


def _rope_theta(raw: dict[str, Any], path: Path) -> float:
    params = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and isinstance(params, dict):
        return _optional(params, "rope_theta", path, float, 10000.0)
    return _optional(raw, "rope_theta", path, float, 10000.0)


def parse_config(raw: dict[str, Any], path: Path, dtype: torch.dtype) -> LlamaConfig:
    """A LlamaConfig from the parsed ``config.json`` dict (``path`` is for messages)."""
    model_type = raw.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: key 'model_type' is {model_type!r}; supported: {_SUPPORTED_MODEL_TYPES}"
        )
    hidden = _require(raw, "hidden_size", path, int)
    heads = _require(raw, "num_attention_heads", path, int)
    kv_heads = _optional(raw, "num_key_value_heads", path, int, heads)
    head_dim = _optional(raw, "head_dim", path, int, hidden // heads if heads > 0 else 0)
    try:
        return LlamaConfig(
            vocab_size=_require(raw, "vocab_size", path, int),
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size", path, int),
            num_hidden_layers=_require(raw, "num_hidden_layers", path, int),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_optional(raw, "max_position_embeddings", path, int, 2048),
            rms_norm_eps=_optional(raw, "rms_norm_eps", path, float, 1e-6),
            rope_theta=_rope_theta(raw, path),
            rope_scaling=_rope_scaling(raw, path),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=_optional(raw, "bos_token_id", path, int, None),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), path),
            dtype=dtype,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _pick_dtype(raw: dict[str, Any], device: torch.device, dtype: torch.dtype | None):
    if dtype is not None:
        return dtype
    if device.type != "cuda":
        return torch.float32  # bf16/fp16 matmuls are slow or missing on CPUs
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return _DTYPES.get(name, torch.float32)


def read_config(model_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``model_dir``."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: top level must be a JSON object")
    return raw


def _load_weights(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    tensors[key] = handle.get_tensor(key).to(device=device, dtype=dtype)
                    origin[key] = file
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors: {exc}") from exc
    return tensors, origin


def load_model(
    model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None
) -> LoadedModel:
    """The model (eval mode, on ``device``) and its tokenizer from a local HF directory."""
    model_dir = Path(model_dir)
    dev = torch.device(device)
    raw = read_config(model_dir)
    cfg = parse_config(raw, model_dir / "config.json", _pick_dtype(raw, dev, dtype))
    # config.json's ids first (the first stays eos_token_id), then generation_config.json's.
    try:
        eos_ids = tuple(dict.fromkeys(cfg.eos_token_ids + model_eos_token_ids(model_dir)))
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc
    if eos_ids != cfg.eos_token_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=eos_ids)
    tensors, origin = _load_weights(model_dir, dev, cfg.dtype)

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: weights missing key {missing[0]!r} ({len(missing)} missing in all)"
        )
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        key = unexpected[0]
        raise ModelLoadError(f"{origin[key]}: unexpected key {key!r} (not a Llama weight)")
    for key, ref in expected.items():
        if tuple(tensors[key].shape) != tuple(ref.shape):
            raise ModelLoadError(
                f"{origin[key]}: key {key!r} has shape {tuple(tensors[key].shape)}, "
                f"config.json implies {tuple(ref.shape)}"
            )
    model.load_state_dict(tensors, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return LoadedModel(model=model.eval(), tokenizer=load_tokenizer(model_dir, cfg))


def load_tokenizer(model_dir: Path, cfg: LlamaConfig) -> Tokenizer:
    """The model directory's tokenizer as the router loads it
    (:func:`edge.tokenizer.load_tokenizer_or_bytes`: tokenizer.json and
    tokenizer_config.json, else bytes if the model's vocab covers them)."""
    try:
        tok = load_tokenizer_or_bytes(model_dir)
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc
    if isinstance(tok, ByteTokenizer) and tok.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            f"{model_dir / 'tokenizer.json'}: no tokenizer.json, and the byte tokenizer needs "
            f"vocab_size >= {tok.vocab_size} (config has {cfg.vocab_size})"
        )
    return tok


def hf_config_dict(cfg: LlamaConfig) -> dict[str, Any]:
    """``config.json`` content for ``cfg`` as transformers' LlamaConfig reads it."""
    dtype_name = {v: k for k, v in _DTYPES.items()}[cfg.dtype]
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        # One id as an int (as most checkpoints write it), several as a list.
        "eos_token_id": (
            list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id
        ),
        "torch_dtype": dtype_name,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return out


def save_hf(model: LlamaForCausalLM, model_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (HF parameter names) to ``model_dir``."""
    from safetensors.torch import save_file

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps(hf_config_dict(model.config), indent=2) + "\n", encoding="utf-8"
    )
    # clone(): a fused model's projections are views into one concatenation, and safetensors
    # refuses tensors that share memory.
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed_tokens; HF re-ties it
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
