"""The tokenizer.json written for peers gives kvroute's ByteTokenizer ids, decoded back."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from edge.tokenizer import ByteTokenizer
from fleetsim.replay.byte_tokenizer import BOS_ID, EOS_ID, SPECIALS, write_byte_tokenizer


@pytest.mark.parametrize(
    "text", ["", "Az~!", 'quote " and \\ backslash', "tab\tnew\nline  spaces ", "é ü 漢字 🙂"]
)
def test_same_ids_as_kvroute_byte_tokenizer(tmp_path, text):
    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids == ByteTokenizer().encode(text)  # no BOS added, one id per UTF-8 byte
    assert tok.decode(ids) == text


def test_specials_are_kvroute_byte_tokenizer_ids(tmp_path):
    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in SPECIALS] == [256, 257, 258, 259]
    assert (BOS_ID, EOS_ID) == (ByteTokenizer.BOS, ByteTokenizer.EOS)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["eos_token"] == SPECIALS[2]
