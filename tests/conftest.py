"""Shared fixtures: tiny random-weight checkpoints for each architecture, built with
transformers and saved to a temp dir (`tests.helpers.checkpoints`), and the default model
(loaded once per session)."""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest

from tests.helpers.checkpoints import ARCHITECTURES, save_tiny_checkpoint, save_tiny_llama, save_tiny_smol

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter (CPU tensors), which must be chosen
# before Triton is first imported (torch does not import it).
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module", autouse=True)
def _hand_back_memory_after_each_module():
    """After each module: collect the engines it left in reference cycles, and hand the freed
    heap back to the OS. Without it, the suite's one process keeps the high-water mark of every
    module's KV caches (an LLM with the default budget takes 2.4 GB here) and ran out of the
    machine's 24 GiB near the end of the run."""
    yield
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_checkpoint(request, tmp_path_factory):
    """(architecture, directory, HF model) of a tiny random-weight checkpoint."""
    directory = tmp_path_factory.mktemp(request.param)
    model = save_tiny_checkpoint(request.param, directory)
    return request.param, str(directory), model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Llama checkpoint with a word-level tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(directory)
    return str(directory)


@pytest.fixture(scope="session")
def default_llm():
    from pagedrs import LLM

    return LLM(kv_cache_memory="256MiB", max_num_seqs=32)


@pytest.fixture(scope="session")
def tiny_smol(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Llama with the default model's byte-level tokenizer
    (49,152 tokens, its chat template): random weights that can spell any text, for
    structured outputs and tool calls."""
    directory = tmp_path_factory.mktemp("tiny-smol")
    save_tiny_smol(directory)
    return str(directory)
