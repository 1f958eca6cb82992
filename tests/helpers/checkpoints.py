"""Tiny random-weight checkpoints, written with transformers to a directory:
- ``TINY``: the shape every tiny model shares (320 words, 2 layers, 4 query and 2 KV heads).
- `save_word_tokenizer`: a word-level tokenizer whose token ``i`` is the word ``w{i}``.
- `save_tiny_checkpoint`, `save_tiny_llama`, `save_tiny_smol`: what conftest.py's fixtures hold."""

from __future__ import annotations

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def tiny_config(architecture: str):
    """transformers' config of ``architecture`` (one of `ARCHITECTURES`) in the `TINY` shape."""
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


def save_tiny_checkpoint(architecture: str, directory):
    """Saves a tiny random-weight ``architecture`` with a word-level tokenizer in ``directory``;
    returns the transformers model (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture)).eval()
    # Random weights give nearly flat logits; scale the head so greedy choices are clear.
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return model


def save_tiny_llama(directory) -> None:
    """Saves a tiny random-weight Llama with a word-level tokenizer in ``directory``."""
    import torch
    import transformers

    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])


def save_tiny_smol(directory) -> None:
    """Saves a tiny random-weight Llama with the default model's byte-level tokenizer (49,152
    tokens, its chat template) in ``directory``: random weights that can spell any text."""
    import torch
    import transformers

    from pagedrs.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    torch.manual_seed(11)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)})
    config.eos_token_id = tokenizer.eos_token_id
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
