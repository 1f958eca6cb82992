"""Shared fixtures: tiny random-weight checkpoints for each architecture, built with
transformers and saved to a temp dir, and the default model (loaded once per session)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter (CPU tensors), which must be chosen
# before Triton is first imported (torch does not import it).
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _config(architecture: str):
    import transformers

    if architecture == "llama":
        return transformers.LlamaConfig(**TINY)
    if architecture == "mistral":
        return transformers.MistralConfig(**TINY, sliding_window=None)
    if architecture == "qwen2":
        return transformers.Qwen2Config(**TINY)
    if architecture == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=16)
    raise ValueError(architecture)


@pytest.fixture(scope="session", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny_checkpoint(request, tmp_path_factory):
    """(architecture, directory, HF model) of a tiny random-weight checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_config(request.param)).eval()
    # Random weights give nearly flat logits; scale the head so greedy choices are clear.
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return request.param, str(directory), model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Llama checkpoint with a word-level tokenizer."""
    import torch
    import transformers

    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return str(directory)


def save_word_tokenizer(directory, vocab_size: int) -> None:
    """A real (word-level) tokenizer for a tiny checkpoint: token ``i`` is the word ``w{i}``;
    ``w1`` is EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1")
    # A plain chat template: each message's words, then the assistant's turn marker.
    fast.chat_template = (
        "{% for message in messages %}w2 {{ message['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3{% endif %}"
    )
    fast.save_pretrained(directory)


@pytest.fixture(scope="session")
def default_llm():
    from pagedrs import LLM

    return LLM(kv_cache_memory="256MiB", max_num_seqs=32)


@pytest.fixture(scope="session")
def tiny_smol(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Llama with the default model's byte-level tokenizer
    (49,152 tokens, its chat template): random weights that can spell any text, for
    structured outputs and tool calls."""
    import torch
    import transformers

    from pagedrs.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    torch.manual_seed(11)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)})
    config.eos_token_id = tokenizer.eos_token_id
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny-smol")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
