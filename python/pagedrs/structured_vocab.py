"""The bytes each token of a Hugging Face tokenizer stands for: the vocabulary of
``GrammarMatchers`` (structured outputs).

A grammar constrains text, so the mask needs every token's exact bytes, partial UTF-8
sequences included. Three schemes, told apart by the fast tokenizer's decoder:

- byte-level BPE (GPT-2, SmolLM2, Qwen, Llama 3): each character of a token's piece stands
  for one byte through GPT-2's byte-to-unicode table;
- SentencePiece style (Llama 2, Mistral): ``▁`` is a space and ``<0xNN>`` is the byte NN;
- anything else: the token decoded on its own, when that gives whole characters.

Special tokens get ``b""``: a grammar never produces them (EOS is passed to
``GrammarMatchers`` on its own). Non-special added tokens stand for their text.
"""

from __future__ import annotations

import json
import re
import weakref
from functools import cache
from typing import Any

__all__ = ["token_bytes"]

# tokenizer -> (its length when computed, its token bytes); weak, so engines that drop a
# tokenizer drop its entry too.
_TOKENIZER_TO_BYTES: weakref.WeakKeyDictionary[Any, tuple[int, list[bytes]]] = weakref.WeakKeyDictionary()

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any) -> list[bytes]:
    """``result[i]`` is the text token ``i`` stands for, as bytes; ``b""`` for special
    tokens and for tokens whose bytes cannot be known. ``len(result)`` is one past the
    largest token id. Cached per tokenizer (recomputed if tokens were added since)."""
    try:
        cached = _TOKENIZER_TO_BYTES.get(tokenizer)
    except TypeError:  # not weakly referenceable: no cache
        cached = None
    if cached is not None and cached[0] == len(tokenizer):
        return cached[1]
    result = _compute_token_bytes(tokenizer)
    try:
        _TOKENIZER_TO_BYTES[tokenizer] = (len(tokenizer), result)
    except TypeError:
        pass
    return result


def _compute_token_bytes(tokenizer: Any) -> list[bytes]:
    piece_to_id: dict[str, int] = tokenizer.get_vocab()
    id_to_added = getattr(tokenizer, "added_tokens_decoder", {})
    special_ids = set(tokenizer.all_special_ids)
    special_ids.update(token_id for token_id, added in id_to_added.items() if added.special)
    piece_bytes = _piece_decoder(tokenizer)
    result = [b""] * (max(piece_to_id.values(), default=-1) + 1)
    for piece, token_id in piece_to_id.items():
        if token_id in special_ids:
            continue
        if token_id in id_to_added:
            # Added tokens are matched as raw text, not as encoded pieces.
            result[token_id] = id_to_added[token_id].content.encode()
        elif piece_bytes is not None:
            result[token_id] = piece_bytes(piece)
        else:
            result[token_id] = _decoded_bytes(tokenizer, token_id)
    return result


def _piece_decoder(tokenizer: Any) -> Any:
    """A function from a vocabulary piece to its bytes, or ``None`` when the tokenizer is
    neither byte-level nor SentencePiece style."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        return _byte_level_bytes
    space = None
    for step in steps:
        if step.get("type") == "Replace" and step.get("content") == " ":
            space = step.get("pattern", {}).get("String")
        elif step.get("type") == "Metaspace":
            space = step.get("replacement", "▁")
    if space is None and "ByteFallback" not in kinds:
        return None

    def sentencepiece_bytes(piece: str) -> bytes:
        match = _BYTE_TOKEN.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return (piece.replace(space, " ") if space else piece).encode()

    return sentencepiece_bytes


@cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's table, inverted: printable bytes stand for themselves, the other 68 for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    table = {chr(byte): byte for byte in printable}
    table.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return table


def _byte_level_bytes(piece: str) -> bytes:
    table = _unicode_to_byte()
    try:
        return bytes(table[char] for char in piece)
    except KeyError:  # not a byte-level piece: take it as text
        return piece.encode()


def _decoded_bytes(tokenizer: Any, token_id: int) -> bytes:
    text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # A token holding part of a character decodes to U+FFFD: its bytes are unknown.
    return b"" if "\ufffd" in text else text.encode()
