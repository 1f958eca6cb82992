"""What scoring text pairs needs besides the engine, shared by `LLM.score` and the server's
``/v1/score`` and ``/v1/rerank``.

A pair is scored one of two ways, as vLLM does:

- by a classifier (a ``*ForSequenceClassification`` checkpoint, or a causal model made one with
  ``classifier_from_token``): the two texts are encoded as one input with the tokenizer's pair
  template (``tokenizer(text_1, text_2)``: the special tokens the tokenizer puts around and
  between a pair), and the score is the classifier's sigmoid (one label);
- by an embedding model (any other): each text is embedded on its own and the score is the
  cosine similarity of the two embeddings.
"""

from __future__ import annotations

from typing import Any

import torch


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
    """One input of both texts, joined by the tokenizer's pair template."""
    return list(tokenizer(text_1, text_2)["input_ids"])


def cosine(first: torch.Tensor, second: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(first.float(), second.float(), dim=0))


def classifier_score(scores: torch.Tensor) -> float:
    """A pair's score from a classifier's output (activated): its one label's value. A head of
    several labels gives no single score."""
    if scores.numel() != 1:
        raise ValueError(f"scoring needs a classifier with one label; this model's head has {scores.numel()}")
    return float(scores.reshape(()))


def pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of ``score``'s inputs: one text against each of several (1 to N), or
    the i-th of one list against the i-th of the other (N to N)."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        if not texts:
            raise ValueError(f"{name} is empty")
        if not all(isinstance(text, str) for text in texts):
            raise ValueError(f"{name} must be a string or a list of strings")
    if len(firsts) == 1:
        return [(firsts[0], text) for text in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2"
        )
    return list(zip(firsts, seconds))
