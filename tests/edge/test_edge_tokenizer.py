"""edge.tokenizer: loading a model directory's tokenizer, fingerprints, chat
templates, and round trips through a real (trained here) byte-level BPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bpe import CHAT_TEMPLATE, train_bpe
from edge.frontdoor import BadRequest
from edge.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    TokenizerLoadError,
    load_tokenizer,
    load_tokenizer_or_bytes,
    model_eos_token_ids,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
]


@pytest.fixture(scope="module")
def bpe_json() -> str:
    return train_bpe(512).to_str()


def _write_dir(path: Path, tok_json: str, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok_json)
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    cfg.update(config)
    (path / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if v is not None})
    )
    return path


@pytest.fixture
def model_dir(tmp_path, bpe_json) -> Path:
    return _write_dir(tmp_path / "m", bpe_json, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory, bpe_json) -> HFTokenizer:
    d = _write_dir(tmp_path_factory.mktemp("bpe"), bpe_json, chat_template=CHAT_TEMPLATE)
    return load_tokenizer(d)


# ---- the byte tokenizer ------------------------------------------------------------------


def test_byte_tokenizer_fingerprint_is_fixed_and_depends_on_bos():
    assert ByteTokenizer().fingerprint == ByteTokenizer().fingerprint
    assert len(ByteTokenizer().fingerprint) == 16
    int(ByteTokenizer().fingerprint, 16)  # hex
    assert ByteTokenizer(add_bos=True).fingerprint != ByteTokenizer().fingerprint
    assert ByteTokenizer().eos_token_ids == (ByteTokenizer.EOS,)


def test_default_chat_template_renders_the_documented_form():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(CHAT)
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHello\n<|assistant|>\n"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("Hello\n")
    assert tok.encode_chat(CHAT) == list(text.encode())


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        ("hello", "must be a list"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]\.role must be a string"),
        (["hi"], r"messages\[0\] must be an object"),
    ],
)
def test_malformed_messages_are_bad_requests(messages, match):
    with pytest.raises(ChatTemplateError, match=match) as info:
        ByteTokenizer().apply_chat_template(messages)
    assert isinstance(info.value, BadRequest)
    assert info.value.param == "messages"


# ---- loading -----------------------------------------------------------------------------


def test_load_reads_tokenizer_config(bpe_tok):
    assert bpe_tok.vocab_size == 512
    assert bpe_tok.bos_token_id == bpe_tok.token_to_id("<s>")
    # no config.json: the eos ids come from tokenizer_config.json's eos_token
    assert bpe_tok.eos_token_ids == (bpe_tok.token_to_id("</s>"),)
    assert bpe_tok.eos_token_id == bpe_tok.eos_token_ids[0]
    assert bpe_tok.chat_template == CHAT_TEMPLATE
    ids = bpe_tok.encode("the cache router")
    assert ids[0] == bpe_tok.bos_token_id  # add_bos_token
    assert len(ids) < len("the cache router")  # merges happened
    assert bpe_tok.encode("the cache router", add_special_tokens=False) == ids[1:]


def test_eos_ids_from_config_and_generation_config(model_dir):
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert model_eos_token_ids(model_dir) == (1, 5, 7)
    tok = load_tokenizer(model_dir)
    assert tok.eos_token_ids == (1, 5, 7)
    assert tok.eos_token_id == 1


def test_load_or_bytes(tmp_path, model_dir):
    assert isinstance(load_tokenizer_or_bytes(None), ByteTokenizer)
    assert isinstance(load_tokenizer_or_bytes(tmp_path), ByteTokenizer)  # no tokenizer.json
    assert isinstance(load_tokenizer_or_bytes(model_dir), HFTokenizer)
    with pytest.raises(TokenizerLoadError, match="model directory does not exist"):
        load_tokenizer_or_bytes(tmp_path / "nope")


def _corrupt(model_dir: Path, name: str, text: str) -> Path:
    (model_dir / name).write_text(text)
    return model_dir


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("tokenizer.json", "{not json", r"tokenizer\.json: cannot load tokenizer"),
        ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: not valid JSON"),
        ("tokenizer_config.json", "[1]", r"tokenizer_config\.json: top level must be"),
        (
            "tokenizer_config.json",
            json.dumps({"add_bos_token": "yes"}),
            r"tokenizer_config\.json: key 'add_bos_token' must be true or false",
        ),
        (
            "tokenizer_config.json",
            json.dumps({"chat_template": "{% for %}"}),
            r"tokenizer_config\.json: chat template is not valid Jinja",
        ),
        (
            "tokenizer_config.json",
            json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}),
            r"lists no template named 'default'",
        ),
        (
            "tokenizer_config.json",
            json.dumps({"add_bos_token": True, "bos_token": "<nope>"}),
            r"bos_token '<nope>' is not in the vocabulary",
        ),
        (
            "generation_config.json",
            json.dumps({"eos_token_id": "x"}),
            r"generation_config\.json: key 'eos_token_id' must be an id",
        ),
    ],
)
def test_load_errors_name_the_file(model_dir, name, text, match):
    with pytest.raises(TokenizerLoadError, match=match):
        load_tokenizer(_corrupt(model_dir, name, text))


def test_missing_files(tmp_path):
    with pytest.raises(TokenizerLoadError, match="model directory does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json: missing tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_chat_template_list_form_and_jinja_file(tmp_path, bpe_json):
    listed = [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    tok = load_tokenizer(_write_dir(tmp_path / "a", bpe_json, chat_template=listed))
    assert tok.apply_chat_template(CHAT) == "You are terse.!"
    d = _write_dir(tmp_path / "b", bpe_json)
    (d / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages | length }}]")
    assert load_tokenizer(d).apply_chat_template(CHAT) == "<s>[2]"
    # no template anywhere: the default one
    plain = load_tokenizer(_write_dir(tmp_path / "c", bpe_json))
    assert plain.chat_template == DEFAULT_CHAT_TEMPLATE
    assert plain.encode_chat(CHAT)[0] == plain.bos_token_id  # the default writes no bos


# ---- chat templates ----------------------------------------------------------------------


def test_model_chat_template_renders_and_encodes_one_bos(bpe_tok):
    text = bpe_tok.apply_chat_template(CHAT)
    assert text == (
        "<s><|start|>system<|sep|>You are terse.<|end|>"
        "<|start|>user<|sep|>Hello<|end|><|start|>assistant<|sep|>"
    )
    ids = bpe_tok.encode_chat(CHAT)
    assert ids.count(bpe_tok.bos_token_id) == 1 and ids[0] == bpe_tok.bos_token_id
    assert bpe_tok.token_to_id("<|start|>") in ids  # specials in the text are special ids


def test_template_raise_exception_is_a_bad_request(bpe_tok):
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="a system message must come first"):
        bpe_tok.apply_chat_template(messages)


def test_template_is_sandboxed(tmp_path, bpe_json):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = load_tokenizer(_write_dir(tmp_path / "e", bpe_json, chat_template=evil))
    with pytest.raises(ChatTemplateError, match="failed on the messages"):
        tok.apply_chat_template(CHAT)


def test_chat_template_matches_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    ours = load_tokenizer(model_dir)
    for gen in (True, False):
        assert ours.apply_chat_template(CHAT, gen) == ref.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=gen
        )
        expected = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen)
        if isinstance(expected, dict) or hasattr(expected, "input_ids"):
            expected = expected["input_ids"]
        assert ours.encode_chat(CHAT, gen) == list(expected)


# ---- fingerprints ------------------------------------------------------------------------


def test_same_files_same_fingerprint_whatever_the_formatting(tmp_path, bpe_json):
    a = load_tokenizer(_write_dir(tmp_path / "a", bpe_json))
    reformatted = json.dumps(json.loads(bpe_json), indent=4, sort_keys=True)
    b = load_tokenizer(_write_dir(tmp_path / "b", reformatted))
    assert a.fingerprint == b.fingerprint
    # retraining with the same seed reproduces the same vocabulary and merges
    c = load_tokenizer(_write_dir(tmp_path / "c", train_bpe(512).to_str()))
    assert c.fingerprint == a.fingerprint
    # the chat template and the eos ids do not change what an id means
    d = load_tokenizer(_write_dir(tmp_path / "d", bpe_json, chat_template="{{ 1 }}"))
    assert d.fingerprint == a.fingerprint
    assert a.fingerprint != ByteTokenizer().fingerprint


def test_fingerprint_changes_with_what_changes_ids(tmp_path, bpe_json):
    base = load_tokenizer(_write_dir(tmp_path / "base", bpe_json)).fingerprint
    raw = json.loads(bpe_json)
    raw["model"]["merges"] = raw["model"]["merges"][:-1]
    fewer_merges = load_tokenizer(_write_dir(tmp_path / "m", json.dumps(raw)))
    other_seed = load_tokenizer(_write_dir(tmp_path / "s", train_bpe(512, seed=1).to_str()))
    no_bos = load_tokenizer(_write_dir(tmp_path / "b", bpe_json, add_bos_token=False))
    raw = json.loads(bpe_json)
    raw["added_tokens"][-1]["content"] = "<|other|>"
    other_special = load_tokenizer(_write_dir(tmp_path / "a", json.dumps(raw)))
    prints = {
        base,
        fewer_merges.fingerprint,
        other_seed.fingerprint,
        no_bos.fingerprint,
        other_special.fingerprint,
    }
    assert len(prints) == 5


# ---- round trips -------------------------------------------------------------------------

_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<"),
    max_size=200,
)


@given(text=_TEXT)
@settings(max_examples=200, deadline=None)
def test_bpe_round_trips_any_text(bpe_tok, text):
    ids = bpe_tok.encode(text)
    assert all(0 <= i < bpe_tok.vocab_size for i in ids)
    assert bpe_tok.decode(ids) == text


@given(text=_TEXT)
@settings(max_examples=100, deadline=None)
def test_byte_round_trips_any_text(text):
    tok = ByteTokenizer(add_bos=True)
    assert tok.decode(tok.encode(text)) == text


@given(a=_TEXT, b=_TEXT)
@settings(max_examples=50, deadline=None)
def test_fingerprint_is_a_function_of_the_tokenizer_not_the_text(bpe_tok, a, b):
    before = bpe_tok.fingerprint
    bpe_tok.encode(a + b)
    assert bpe_tok.fingerprint == before
