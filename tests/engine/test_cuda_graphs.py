"""Decode steps through `pagedrs.engine.cuda_graphs`: bucketed batches, persistent buffers,
padding rows. On a GPU the forward is captured and replayed (make gpu-check); here the same
path runs its forward eagerly on the same buffers, with the Triton kernels interpreted, which
checks everything but the capture itself."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedrs.engine import builder
from pagedrs.engine.cuda_graphs import batch_buckets

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, gpu_check runs the captured graphs"),
    pytest.mark.slow,  # the engine's decode through Triton's interpreter
]


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


def _generate(tiny_llama, backend, graphs, monkeypatch):
    from pagedrs import LLM, SamplingParams

    monkeypatch.setattr(builder, "wants_decode_graphs", lambda *args: graphs)
    llm = LLM(
        tiny_llama,
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        kv_cache_memory="4MiB",
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    # 5 prompts, n = 1 or 2: decode batches of 5, 6, 7 sequences (buckets of 8: padded), and
    # smaller ones as requests finish at different lengths.
    prompts = [list(range(3, 40)), list(range(3, 40)) + [7, 8], [11, 5, 200, 9], [4] * 20, [300, 2]]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, n=1 + i % 2) for i in range(5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_used_blocks == 0
    return [[c.token_ids for c in o.outputs] for o in outputs], llm.engine.runner


def test_graphed_decode_matches_the_reference(tiny_llama, monkeypatch):
    """Greedy tokens with decode steps through the graph path (padded to buckets, keys of the
    padding rows written to the scratch block) equal the torch reference's; steps the graphs do
    not cover (prefill chunks, copy-on-write copies for n = 2) run eagerly in between."""
    reference, _ = _generate(tiny_llama, "torch", False, monkeypatch)
    graphed, runner = _generate(tiny_llama, "triton", True, monkeypatch)
    assert graphed == reference
    graphs = runner.graphs
    assert graphs is not None and graphs.num_replays > 10
    assert graphs.buckets == [1, 2, 4, 8]
    # The scratch block past the scheduler's took the padding rows' keys (block 0's stayed real).
    scratch_block = runner.kv_caches[0][0][-1]
    assert scratch_block[0].abs().sum() > 0 and scratch_block[1:].abs().sum() == 0


def test_graphs_only_on_one_gpu_rank_without_enforce_eager(tiny_llama, monkeypatch):
    from pagedrs.config import EngineConfig

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    causal = SimpleNamespace(architectures=["LlamaForCausalLM"])
    assert builder.wants_decode_graphs(EngineConfig(), gpu, None, causal)
    assert not builder.wants_decode_graphs(EngineConfig(enforce_eager=True), gpu, None, causal)
    # A sequence classifier has no logits to capture, and does not decode.
    classifier = SimpleNamespace(architectures=["LlamaForSequenceClassification"])
    assert not builder.wants_decode_graphs(EngineConfig(), gpu, None, classifier)
    assert not builder.wants_decode_graphs(EngineConfig(), gpu, object(), causal)  # tensor parallel
    assert not builder.wants_decode_graphs(EngineConfig(), cpu, None, causal)
    _, runner = _generate(tiny_llama, "triton", False, monkeypatch)
    assert runner.graphs is None


def test_steps_the_graphs_do_not_cover(tiny_llama, monkeypatch):
    _, runner = _generate(tiny_llama, "triton", True, monkeypatch)
    graphs = runner.graphs
    tables = np.zeros((3, 4), np.int32)
    decode = np.array([0, 1, 2, 3], np.int32)
    assert graphs.can_run(decode, np.arange(3), tables, 0)
    assert not graphs.can_run(np.array([0, 1, 4, 5], np.int32), np.array([0, 3, 4]), tables, 0)  # a prefill chunk
    assert not graphs.can_run(decode, np.arange(3), tables, 1)  # a block copy first
    assert not graphs.can_run(decode, np.arange(5), tables, 0)  # prompt-logprob rows
    assert not graphs.can_run(np.arange(10, dtype=np.int32), np.arange(9), np.zeros((9, 4), np.int32), 0)  # > 8
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(8) == 8 and graphs.bucket_for(9) is None
