"""Choosing the attention backend, and the CUDA backend's per-step layout (plain numpy and
torch, so it is checked on every machine; the kernels themselves in test_cuda_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.attention import select_backend
from pagedrs.attention.cuda_backend import CudaAttentionMetadata
from pagedrs.kernels import cpu as cpu_kernels
from tests.helpers.batches import mixed_step


def test_select_backend(monkeypatch):
    import pagedrs.attention.kernel_choice as kernel_choice

    # auto on a GPU times the kernels that take the shape; here a table stands in for the GPU.
    timings = {("decode", "triton"): 1.0, ("prefill", "triton"): 1.0}
    monkeypatch.setattr(kernel_choice, "measure", lambda kernels, *args: timings)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    # auto on the CPU: the compiled kernel where it builds (make test builds it first).
    assert select_backend("auto", cpu).name == ("cpu" if cpu_kernels.available() else "torch")
    assert select_backend("auto", gpu).name == "cuda"
    assert select_backend("torch", gpu).name == "torch"  # the reference, on any device
    assert select_backend("torch", cpu).name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("cuda", cpu)
    with pytest.raises(ValueError, match="'cpu' runs on the CPU"):
        select_backend("cpu", gpu)
    with pytest.raises(ValueError, match="one of auto, torch, cpu, cuda, triton"):
        select_backend("flash", cpu)
    # Shapes the CUDA kernels do not take: auto keeps the GPU backend while Triton takes them
    # (any head size up to 256, any group, power-of-two blocks), a forced "cuda" says why.
    assert select_backend("auto", gpu, head_dim=96, num_heads=32, num_kv_heads=32).name == "cuda"
    assert select_backend("auto", gpu, head_dim=128, num_heads=32, num_kv_heads=1).name == "cuda"
    assert select_backend("auto", gpu, head_dim=96, num_heads=8, num_kv_heads=8, block_size=24).name == "torch"
    assert select_backend("auto", gpu, head_dim=512, num_heads=8, num_kv_heads=8).name == "torch"
    with pytest.raises(ValueError, match="head size 96"):
        select_backend("cuda", gpu, head_dim=96, num_heads=8, num_kv_heads=8)
    with pytest.raises(ValueError, match="block size 24"):
        select_backend("triton", gpu, head_dim=64, num_heads=8, num_kv_heads=8, block_size=24)


def test_attention_sinks_plan_the_backends_that_compute_them():
    """gpt-oss's sinks: the GPU kernels have none (refused when asked for, the reference under
    auto on a GPU); the CPU kernel has them."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for name in ("cuda", "triton"):
        with pytest.raises(ValueError, match="has no attention sinks"):
            select_backend(name, gpu, sinks=True)
    assert select_backend("auto", gpu, sinks=True).name == "torch"
    assert select_backend("auto", cpu, sinks=True).name == ("cpu" if cpu_kernels.available() else "torch")


def test_auto_falls_back_to_the_reference_when_the_cpu_kernel_cannot_build(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpu_kernels, "load", no_compiler)
    cpu_kernels.available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="pagedrs"):
            assert select_backend("auto", torch.device("cpu")).name == "torch"
            assert select_backend("auto", torch.device("cpu")).name == "torch"
        assert [r.getMessage() for r in caplog.records] == [
            "the CPU kernels did not build (c++: command not found); attention and sampling use torch ops"
        ]  # once, however often the engine asks
        with pytest.raises(RuntimeError, match="'cpu': the CPU kernel did not build"):
            select_backend("cpu", torch.device("cpu"))
        # The sampler takes the same answer: its torch ops, no second warning.
        from pagedrs.sample import Sampler

        assert not Sampler(10).fused and len(caplog.records) == 1
    finally:
        cpu_kernels.available.cache_clear()


def test_engine_refuses_cuda_backend_without_a_gpu(tiny_llama):
    from pagedrs import LLM

    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(tiny_llama, device="cpu", attention_backend="cuda", kv_cache_memory="4MiB")


def test_cuda_metadata_splits_decodes_and_prefill_chunks():
    step = mixed_step()  # rows 0 | 1 2 3 | 4: decode, a prefill chunk of 3, decode
    block_tables = step["block_tables"]
    meta = CudaAttentionMetadata.build(**step)
    decodes, prefills = meta.decodes, meta.prefills
    assert decodes.rows.tolist() == [0, 4] and decodes.cu_seqlens_q.tolist() == [0, 1, 2]
    assert decodes.context_lens.tolist() == [20, 40] and decodes.max_context_len == 40
    assert decodes.block_tables.tolist() == [[5, 6, 0], [1, 2, 3]] and decodes.block_tables.dtype == torch.int32
    assert prefills.rows.tolist() == [1, 2, 3] and prefills.cu_seqlens_q.tolist() == [0, 3]
    assert prefills.block_tables.tolist() == [[7]] and prefills.num_rows == 3
    assert meta.sliding_window == 0
    # A batch of decodes only covers every row in order: no gather.
    only = CudaAttentionMetadata.build(
        positions=np.array([19, 39]),
        slot_mapping=np.arange(2),
        query_start_loc=np.array([0, 1, 2], dtype=np.int32),
        context_lens=np.array([20, 40], dtype=np.int32),
        block_tables=block_tables[[0, 2]],
        block_size=16,
        sliding_window=8,
        device=torch.device("cpu"),
    )
    assert only.decodes.rows is None and only.prefills is None and only.sliding_window == 8


def test_auto_plan_keeps_the_faster_kernel_per_phase():
    """`choose_plan` times each usable kernel on a decode batch and a prefill chunk (here the
    timer reads a table: the real one uses CUDA events) and keeps the faster per phase."""
    from pagedrs.attention.kernel_choice import choose_plan

    timings = {("decode", "cuda"): 3.0, ("decode", "triton"): 2.0, ("prefill", "cuda"): 5.0, ("prefill", "triton"): 9.0}
    calls = []

    def fake_measure(kernels, *args):
        calls.append(kernels)
        return {key: s for key, s in timings.items() if key[1] in kernels}

    import pagedrs.attention.kernel_choice as kernel_choice

    original = kernel_choice.measure
    kernel_choice.measure = fake_measure
    try:
        gpu = torch.device("cuda")
        plan = choose_plan("auto", gpu, torch.bfloat16, 32, 8, 128, 16, timer=lambda fn: 0.0)
        assert (plan.decode, plan.prefill) == ("triton", "cuda") and calls == [["cuda", "triton"]]
        # Head size 96: only Triton takes it, nothing to time.
        plan = choose_plan("auto", gpu, torch.bfloat16, 8, 8, 96, 16)
        assert (plan.decode, plan.prefill) == ("triton", "triton") and len(calls) == 1
        plan = choose_plan("cuda", gpu, torch.bfloat16, 8, 8, 96, 16)  # forced: as asked
        assert (plan.decode, plan.prefill) == ("cuda", "cuda")
        # Triton within the margin of CUDA: CUDA stays (noise must not flip the choice).
        timings[("decode", "triton")] = 2.9
        plan = choose_plan("auto", gpu, torch.bfloat16, 32, 8, 128, 16)
        assert (plan.decode, plan.prefill) == ("cuda", "cuda")
        # A kernel that failed on this GPU is absent from the timings; none at all: the reference.
        del timings[("decode", "cuda")], timings[("prefill", "cuda")]
        plan = choose_plan("auto", gpu, torch.bfloat16, 32, 8, 128, 16)
        assert (plan.decode, plan.prefill) == ("triton", "triton")
        timings.clear()
        assert choose_plan("auto", gpu, torch.bfloat16, 32, 8, 128, 16) is None
    finally:
        kernel_choice.measure = original


@pytest.mark.slow  # Triton's interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors go through Triton's interpreter only without a GPU")
def test_kernel_timing_runs_every_launch():
    """The measurement itself, on CPU tensors through Triton's interpreter: one time per
    (phase, kernel), every launch run; a kernel that raises is left out."""
    from pagedrs.attention.kernel_choice import measure

    runs = []
    seconds = measure(["triton"], torch.device("cpu"), torch.float32, 4, 2, 16, 16, lambda fn: runs.append(fn()) or 1.0)
    assert seconds == {("decode", "triton"): 1.0, ("prefill", "triton"): 1.0}
    assert [out.shape for out in runs] == [(32, 4, 16), (512, 4, 16)]

    def failing(fn):
        raise RuntimeError("out of resources")

    assert measure(["triton"], torch.device("cpu"), torch.float32, 4, 2, 16, 16, failing) == {}


def test_triton_metadata_tiles_each_phase():
    from pagedrs.attention.cuda_backend import KernelPlan

    plan = KernelPlan("triton", "cuda", 8, 2, 64)
    meta = plan.build(**mixed_step())
    assert meta.decodes.triton is not None and meta.prefills.triton is None and meta.cuda_writes
    assert meta.decodes.triton.tile_seqs.tolist() == [0, 1] and meta.decodes.triton.tile_rows.tolist() == [0, 1]
    assert meta.decodes.triton.config.block_m == 16 and meta.decodes.triton.num_segments == 1  # 40 tokens: too short


@pytest.mark.slow  # the engine through Triton's interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs this in gpu_check's end-to-end step")
def test_engine_on_the_triton_backend_matches_the_reference(tiny_llama):
    """The whole engine with every attention row through the Triton kernels (interpreted on
    the CPU): greedy tokens equal the torch reference's, over prefill chunks (a long prompt
    chunked), prefix-cache hits and decode, with n > 1 sharing blocks."""
    from pagedrs import LLM, SamplingParams

    prompts = [list(range(3, 40)), list(range(3, 40)) + [7, 8], [11, 5, 200, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            tiny_llama,
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            kv_cache_memory="4MiB",
            max_num_batched_tokens=32,
            max_num_seqs=8,
            enable_prefix_caching=True,
        )
        results[backend] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "triton":
            plan = llm.engine.runner.attention_backend.kernel_plan
            assert (plan.decode, plan.prefill) == ("triton", "triton")
            assert llm.engine.scheduler.stats().num_used_blocks == 0
    assert results["triton"] == results["torch"]
