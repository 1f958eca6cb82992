"""Structured-output masks (``GrammarMatchers``) on the default model's vocabulary.

Each grammar kind is driven by random walks: every step fills the mask, picks a random
allowed token (EOS, when allowed, with some probability) and advances. Whatever text a walk
ends with must be in the grammar's language, checked independently of llguidance (json,
jsonschema, re, a small recursive-descent parser).
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from pagedrs import GrammarMatchers, InvalidArgumentError
from pagedrs.structured_vocab import token_bytes

try:
    import jsonschema
except ImportError:  # checked by hand below
    jsonschema = None

NUM_PADDING = 64  # the model's logits are wider than its vocabulary

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}

ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


@pytest.fixture(scope="module")
def tokenizer():
    from pagedrs.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def vocab(tokenizer) -> list[bytes]:
    return token_bytes(tokenizer)


@pytest.fixture
def matchers(tokenizer, vocab) -> GrammarMatchers:
    return GrammarMatchers(vocab, tokenizer.eos_token_id, len(vocab) + NUM_PADDING)


def allowed_ids(bitmask_row: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set (bit j of word w is token 32 * w + j)."""
    return np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little"))


class Walker:
    """Random walks through a grammar over the real vocabulary."""

    def __init__(self, matchers: GrammarMatchers, vocab: list[bytes], seed: int, closing_probability: float = 0.5):
        self.matchers = matchers
        self.closing_probability = closing_probability
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.eos = matchers.eos_token_id
        # Tokens that can close something, picked with closing_probability so walks end.
        closing = set(b'"}]),;.')
        self.is_closing = np.array([bool(closing & set(piece)) for piece in vocab] + [False] * NUM_PADDING)

    def pick(self, allowed: np.ndarray) -> int:
        eos_allowed = bool((allowed == self.eos).any())
        others = allowed[allowed != self.eos]
        if eos_allowed and (len(others) == 0 or self.rng.random() < 0.3):
            return self.eos
        closing = others[self.is_closing[others]]
        if len(closing) and self.rng.random() < self.closing_probability:
            return int(self.rng.choice(closing))
        return int(self.rng.choice(others))

    def walk(self, grammar_id: int, max_steps: int = 150) -> str | None:
        """The text of one walk, or ``None`` if it did not end within ``max_steps``."""
        handle = self.matchers.add(grammar_id)
        pieces = []
        try:
            for _ in range(max_steps):
                allowed = allowed_ids(self.matchers.fill_bitmask([handle])[0])
                assert len(allowed) > 0 and allowed.max() < len(self.vocab), "padding or nothing allowed"
                token = self.pick(allowed)
                assert self.matchers.advance(handle, token), f"allowed token {token} refused"
                if token == self.eos:
                    assert self.matchers.is_finished(handle)
                    return b"".join(pieces).decode()
                pieces.append(self.vocab[token])
            return None
        finally:
            self.matchers.remove(handle)

    def texts(self, grammar_id: int, num_walks: int) -> list[str]:
        texts = [self.walk(grammar_id) for _ in range(num_walks)]
        ended = [text for text in texts if text is not None]
        assert len(ended) >= num_walks // 2, f"only {len(ended)} of {num_walks} walks ended"
        return ended


def outside_strings(json_text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', json_text)


def check_person(value) -> None:
    if jsonschema is not None:
        jsonschema.validate(value, PERSON_SCHEMA)
    assert set(value) == {"name", "age", "role", "tags", "address"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["role"] in ("admin", "user")
    assert len(value["tags"]) <= 3 and all(isinstance(tag, str) and len(tag) <= 6 for tag in value["tags"])
    assert set(value["address"]) == {"city", "zip"} and re.fullmatch("[0-9]{5}", value["address"]["zip"])


def parse_arithmetic(text: str) -> None:
    """Raises ValueError unless ``text`` is in ARITHMETIC's language."""
    position = 0

    def expr():
        nonlocal position
        term()
        while position < len(text) and text[position] in "+-":
            position += 1
            term()

    def term():
        nonlocal position
        if position < len(text) and text[position] == "(":
            position += 1
            expr()
            if position >= len(text) or text[position] != ")":
                raise ValueError(f"unclosed parenthesis in {text!r}")
            position += 1
            return
        number = re.match("[0-9]{1,3}", text[position:])
        if number is None:
            raise ValueError(f"expected a number at {position} in {text!r}")
        position += number.end()

    expr()
    if position != len(text):
        raise ValueError(f"trailing text in {text!r}")


# --- token_bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['Hello, world! {"a": [1, 2.5e-3]}', "héllo wörld — 日本語 🙂\n\tñ", "   "])
def test_token_bytes_round_trip_byte_level(tokenizer, vocab, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab[token] for token in ids) == text.encode()


def test_special_tokens_stand_for_no_text(tokenizer, vocab):
    assert len(vocab) == len(tokenizer)
    for token in tokenizer.all_special_ids:
        assert vocab[token] == b""
    assert token_bytes(tokenizer) is vocab  # cached


def test_token_bytes_round_trip_sentencepiece_style():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = {"<unk>": 0, "<s>": 1, "</s>": 2}
    pieces.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll"]:
        pieces[piece] = len(pieces)
    model = models.BPE(vocab=pieces, merges=[("▁", "h"), ("l", "l")], byte_fallback=True, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    vocab = token_bytes(tokenizer)
    text = " héllo wörld 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "<0xC3>" in tokenizer.convert_ids_to_tokens(ids)
    assert b"".join(vocab[token] for token in ids) == text.encode()
    assert vocab[:3] == [b"", b"", b""] and vocab[pieces["▁h"]] == b" h"


# --- GrammarMatchers -------------------------------------------------------------------------


def test_json_schema_walks_validate_and_are_compact(matchers, vocab):
    grammar_id = matchers.compile("json_schema", json.dumps(PERSON_SCHEMA))
    for text in Walker(matchers, vocab, seed=1).texts(grammar_id, num_walks=10):
        check_person(json.loads(text))
        assert not re.search(r"\s", outside_strings(text)), text


def test_json_object_walks_are_objects(matchers, vocab):
    grammar_id = matchers.compile("json_object", "")
    values = []
    for text in Walker(matchers, vocab, seed=2, closing_probability=0.3).texts(grammar_id, num_walks=10):
        values.append(json.loads(text))
        assert not re.search(r"\s", outside_strings(text)), text
    assert all(isinstance(value, dict) for value in values) and any(values)


@pytest.mark.parametrize(
    "pattern", [r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)", r"(café|naïve|日本) [0-9]{1,4}", r"\d{3}-\w+"]
)
def test_regex_walks_match_in_full(matchers, vocab, pattern):
    grammar_id = matchers.compile("regex", pattern)
    for text in Walker(matchers, vocab, seed=3).texts(grammar_id, num_walks=10):
        assert re.fullmatch(pattern, text), text


def test_choice_walks_give_one_choice(matchers, vocab):
    choices = ["Paris", "London", "New York", "東京", 'say "hi"', ""]
    grammar_id = matchers.compile("choice", json.dumps(choices))
    texts = Walker(matchers, vocab, seed=4).texts(grammar_id, num_walks=20)
    assert len(texts) == 20 and set(texts) <= set(choices)


def test_lark_grammar_walks_parse(matchers, vocab):
    grammar_id = matchers.compile("grammar", ARITHMETIC)
    for text in Walker(matchers, vocab, seed=5).texts(grammar_id, num_walks=10):
        parse_arithmetic(text)


def test_after_the_last_character_only_eos_is_allowed(tokenizer, matchers):
    handle = matchers.add(matchers.compile("choice", '["yes", "no"]'))
    (token,) = tokenizer.encode("yes", add_special_tokens=False)
    assert list(allowed_ids(matchers.fill_bitmask([handle])[0])).count(matchers.eos_token_id) == 0
    assert matchers.advance(handle, token)
    assert matchers.is_finished(handle)
    assert list(allowed_ids(matchers.fill_bitmask([handle])[0])) == [matchers.eos_token_id]
    assert matchers.advance(handle, matchers.eos_token_id)


def test_disallowed_token_is_refused_and_the_state_kept(matchers, vocab):
    handle = matchers.add(matchers.compile("regex", "[0-9]{2}"))
    before = matchers.fill_bitmask([handle])
    for piece in [b"a", b" ", b"{"]:
        assert not matchers.advance(handle, vocab.index(piece))
    assert not matchers.advance(handle, matchers.eos_token_id)
    assert np.array_equal(matchers.fill_bitmask([handle]), before)
    assert matchers.advance(handle, vocab.index(b"1")) and matchers.advance(handle, vocab.index(b"2"))
    assert matchers.is_finished(handle)
    assert not matchers.advance(handle, matchers.vocab_size - 1)  # a padding id
    with pytest.raises(InvalidArgumentError, match="vocab_size"):
        matchers.advance(handle, matchers.vocab_size)


def test_masks_have_one_row_per_handle_and_no_padding_bits(matchers, vocab):
    handle = matchers.add(matchers.compile("json_object", ""))
    bitmask = matchers.fill_bitmask([handle])
    assert bitmask.dtype == np.int32 and bitmask.shape == (1, -(-matchers.vocab_size // 32))
    assert allowed_ids(bitmask[0]).max() < len(vocab)
    assert matchers.fill_bitmask([]).shape == (0, bitmask.shape[1])


def test_compile_is_cached_by_kind_and_spec(matchers):
    first = matchers.compile("regex", "[ab]+")
    assert matchers.compile("regex", "[ab]+") == first
    assert matchers.compile("grammar", "start: /[ab]+/") != first
    assert matchers.compile("json_object", "") == matchers.compile("json_object", "{}")
    assert (matchers.num_compiled, matchers.cache_hits) == (3, 2)
    assert matchers.compile_seconds_total > 0


def test_evicted_grammar_must_be_compiled_again(tokenizer, vocab):
    matchers = GrammarMatchers(vocab, tokenizer.eos_token_id, len(vocab), max_cached_grammars=1)
    first = matchers.compile("regex", "a+")
    handle = matchers.add(first)
    matchers.compile("regex", "b+")
    with pytest.raises(KeyError, match="compile it again"):
        matchers.add(first)
    assert len(matchers.fill_bitmask([handle])) == 1  # live matchers outlive their grammar


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", '{"type": "array", "uniqueItems": true}', "unsupported keywords.*uniqueItems"),
        ("json_schema", '{"type": ', "not JSON"),
        ("json_schema", "[]", "must be a JSON object"),
        ("json_schema", '{"type": "strin"}', "strin"),
        ("regex", "(ab", "unclosed group"),
        ("grammar", "start: foo", "unknown name"),
        ("grammar", 'root ::= "a"', "GBNF"),
        ("choice", "[]", "empty"),
        ("choice", '"a"', "list of strings"),
        ("lark", "start: /a/", "grammar kind must be one of"),
    ],
)
def test_invalid_specs_raise_value_error_naming_the_problem(matchers, kind, spec, message):
    with pytest.raises(ValueError, match=message) as raised:
        matchers.compile(kind, spec)
    assert isinstance(raised.value, InvalidArgumentError)
    assert matchers.num_compiled == 0


def test_filling_32_rows_at_once_equals_filling_them_one_by_one(matchers, vocab):
    specs = [
        ("json_schema", json.dumps(PERSON_SCHEMA)),
        ("json_object", ""),
        ("regex", r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"),
        ("choice", '["Paris", "London"]'),
        ("grammar", ARITHMETIC),
    ]
    handles = [matchers.add(matchers.compile(*specs[i % len(specs)])) for i in range(32)]
    walker = Walker(matchers, vocab, seed=6)
    for _ in range(8):
        together = matchers.fill_bitmask(handles)
        for row, handle in enumerate(handles):
            assert np.array_equal(together[row], matchers.fill_bitmask([handle])[0])
        for row, handle in enumerate(handles):
            if not matchers.is_finished(handle):
                token = walker.pick(allowed_ids(together[row]))
                assert matchers.advance(handle, token)
    assert matchers.num_masks >= 8 * 2 * 32 and matchers.mask_seconds_total > 0


def test_handles_are_checked(matchers):
    handle = matchers.add(matchers.compile("regex", "a"))
    assert len(matchers) == 1
    with pytest.raises(InvalidArgumentError, match="twice"):
        matchers.fill_bitmask([handle, handle])
    with pytest.raises(KeyError):
        matchers.fill_bitmask([handle + 1])
    with pytest.raises(KeyError):
        matchers.add(12345)
    matchers.remove(handle)
    assert len(matchers) == 0
    with pytest.raises(KeyError, match="never added, or already removed"):
        matchers.remove(handle)
    with pytest.raises(KeyError):
        matchers.is_finished(handle)


def test_bad_vocabulary_is_refused(vocab):
    with pytest.raises(InvalidArgumentError, match="eos_token_id"):
        GrammarMatchers(vocab, len(vocab), len(vocab))
    with pytest.raises(InvalidArgumentError, match="more than vocab_size"):
        GrammarMatchers(vocab, 0, len(vocab) - 1)
