"""Every registered family and rotary variant against Hugging Face transformers: greedy tokens
and their logprobs (1e-4), with prompts past every window and past
``original_max_position_embeddings``, through whole prompts (on the compiled CPU stack and on
the Python layers), small prefill chunks with a cached prefix, and memory tight enough to
preempt, with n=2."""

from __future__ import annotations

import pytest

from pagedrs import LLM, SamplingParams
from pagedrs.engine.kv_layout import decode_peak_blocks
from pagedrs.kernels.cpu import available as cpu_kernels_available
from tests.helpers.families import FAMILIES, hf_greedy_logprobs, save_family, save_unreadable_family

NEW_TOKENS = 24
PROMPTS = [list(range(10, 47)), [7, 7, 7, 300, 12, 64, 19, 81, 44, 3, 99, 250, 31]]  # 37 and 13 tokens
TOLERANCE = 1e-4
PYTHON_LAYERS_ONLY = {"deepseek-v2", "deepseek-v3"}
"""Families the compiled CPU stack does not take (latent attention runs in the Python layers)."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = save_family(request.param, directory)
    oracle = {tuple(prompt): hf_greedy_logprobs(model, prompt, NEW_TOKENS) for prompt in PROMPTS}
    return request.param, str(directory), oracle


def assert_matches(name: str, oracle, prompt: list[int], completion) -> None:
    tokens, logprobs, gaps = oracle[tuple(prompt)]
    ours = list(completion.token_ids)
    assert len(ours) == NEW_TOKENS
    for i, (token, expected) in enumerate(zip(tokens, logprobs)):
        if ours[i] != token:
            assert gaps[i] < 1e-3, f"{name}: diverged at token {i}: ours {ours[i]}, HF {token} (gap {gaps[i]:.2e})"
            return  # a near tie: the rest follows another path
        ours_logprob = completion.logprobs[i][token].logprob
        assert ours_logprob == pytest.approx(expected, abs=TOLERANCE), f"{name}: logprob of token {i}"


def generate(llm: LLM, prompts, n: int = 1):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1, n=n)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_whole_prompts_match_hugging_face(family, backend):
    """``auto``: the CPU kernels and the compiled decoder stack; ``torch``: the Python layers on
    the reference attention (what a GPU or tensor parallelism runs)."""
    name, directory, oracle = family
    llm = LLM(directory, attention_backend=backend)
    on_stack = backend == "auto" and cpu_kernels_available() and name not in PYTHON_LAYERS_ONLY
    assert (llm.engine.runner.cpu_stack is not None) == on_stack
    for prompt, output in zip(PROMPTS, generate(llm, PROMPTS)):
        assert_matches(name, oracle, prompt, output.outputs[0])
    assert llm.engine.scheduler.stats().num_used_blocks == 0


def test_chunks_prefix_hits_preemption_and_n2_match_hugging_face(family):
    name, directory, oracle = family
    llm = LLM(directory, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    # A prompt that shares the first 36 tokens of the long one: its blocks are cached.
    generate(llm, [PROMPTS[0][:36] + [5]])
    outputs = generate(llm, PROMPTS, n=2)
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_cache_hits >= 32
    for prompt, output in zip(PROMPTS, outputs):
        for completion in output.outputs:
            assert_matches(name, oracle, prompt, completion)
    # Preemption: room for the longer sequence alone (and a chunk of 8 tokens in flight in
    # every KV layer group), not for both: sliding groups hold only their window's blocks.
    layout = llm.engine.runner.layout
    peaks = [decode_peak_blocks(layout.group_windows, len(p), len(p) + NEW_TOKENS - 1, 4) for p in PROMPTS]
    num_blocks = max(peaks) + 2 * layout.num_groups
    assert sum(peaks) > num_blocks
    bytes_per_block = llm.engine.runner.cache_bytes_per_block
    tight = LLM(
        directory, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, kv_cache_memory=num_blocks * bytes_per_block
    )
    assert tight.engine.runner.cache_slots[0][0].shape[0] == num_blocks
    outputs = generate(tight, PROMPTS)
    assert tight.engine.scheduler.stats().num_preemptions_total > 0
    for prompt, output in zip(PROMPTS, outputs):
        assert_matches(name, oracle, prompt, output.outputs[0])


def test_llama3_gguf_applies_its_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3's rotary scaling only as the ``rope_freqs`` tensor, which
    transformers' GGUF loader drops: pagedrs applies it, and equals transformers running the
    same weights with ``rope_type: llama3``, past ``original_max_position_embeddings``."""
    from tests.helpers.gguf_writer import llama3_rope_factors, write_gguf

    hf_model = save_family("llama3-rope", tmp_path / "hf")
    oracle = {tuple(prompt): hf_greedy_logprobs(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS}
    path = str(tmp_path / "llama3.gguf")
    write_gguf(path, hf_model, {}, extra_tensors={"rope_freqs.weight": llama3_rope_factors(hf_model.config)})
    llm = LLM(path)
    for prompt, output in zip(PROMPTS, generate(llm, PROMPTS)):
        assert_matches("llama3 gguf", oracle, prompt, output.outputs[0])
    # Without the tensor the same weights rotate plainly: the long prompt's logprobs differ.
    plain = str(tmp_path / "plain.gguf")
    write_gguf(plain, hf_model, {})
    completion = generate(LLM(plain), PROMPTS[:1])[0].outputs[0]
    tokens, logprobs, _ = oracle[tuple(PROMPTS[0])]
    assert completion.token_ids != tokens or any(
        abs(completion.logprobs[i][t].logprob - expected) > 1e-3
        for i, (t, expected) in enumerate(zip(tokens, logprobs))
    )


def test_gguf_metadata_that_would_be_dropped_is_refused(tmp_path):
    from tests.helpers.gguf_writer import write_gguf

    hf_model = save_family("llama-linear", tmp_path / "hf")
    path = str(tmp_path / "scaled.gguf")
    write_gguf(path, hf_model, {}, extra_metadata={"llama.rope.scaling.type": "linear"})
    with pytest.raises(ValueError, match="llama.rope.scaling.type='linear'"):
        LLM(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "su-perb", "rope_theta": 1e4}}, "rope type 'su-perb' is not supported"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
            "(needs 'low_freq_factor'|Missing required keys)",
        ),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta": 1}}, "'beta'"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types must name"),
        ({"hidden_act": "relu"}, "activation 'relu' is not supported"),
    ],
    ids=["unknown-type", "missing-setting", "unknown-setting", "unknown-layer-type", "activation"],
)
def test_bad_configs_are_refused_before_weights_are_read(tmp_path, change, message):
    save_unreadable_family("llama-linear", tmp_path, change)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path))


def test_gguf_of_an_unread_architecture_is_refused(tmp_path):
    """A GGUF architecture whose tensors or metadata pagedrs does not read is refused, not
    loaded as if it were a Llama."""
    from tests.helpers.gguf_writer import write_gguf

    hf_model = save_family("llama-linear", tmp_path / "hf")
    path = str(tmp_path / "starcoder2.gguf")
    write_gguf(path, hf_model, {}, architecture="starcoder2")
    with pytest.raises(ValueError, match="architecture 'starcoder2' are not supported yet"):
        LLM(path)


@pytest.mark.parametrize(
    "family",
    ["phi3-mini", "phi3-longrope", "phi3-partial-sliding", "gemma", "gemma2", "gemma3-llama.cpp", "granite", "olmo2"],
)
def test_gguf_of_other_families_matches_hugging_face(tmp_path, family):
    """llama.cpp's Phi-3 (q/k/v and gate/up fused, window and partial rotary only in the
    metadata; LongRoPE's factors as tensors, prompts past ``original_max_position_embeddings``),
    Gemma 1 and 2 (norms as 1 + w, Gemma 2's own norm names and softcaps in the metadata), Gemma 3
    (q/k norms as 1 + w too, the global layers' linear rotary scaling in the metadata, its local
    layers' pattern and base llama.cpp's fixed ones), Granite (q/k permuted as llama's, its
    multipliers in the metadata) and OLMo 2 (post-norms, full-width q/k norms), whose configs
    pagedrs builds itself (transformers reads none from these files): read from the file
    against transformers running the same weights."""
    from tests.helpers.gguf_writer import write_gguf

    hf_model = save_family(family, tmp_path / "hf")
    oracle = {tuple(prompt): hf_greedy_logprobs(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS}
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(path, hf_model, {}, architecture=family.split("-")[0])
    llm = LLM(path)
    for prompt, output in zip(PROMPTS, generate(llm, PROMPTS)):
        assert_matches(f"{family} gguf", oracle, prompt, output.outputs[0])


def test_phi3_gguf_keeps_its_fused_linears_packed(tmp_path):
    """Phi-3's fused q/k/v and gate/up stay packed (each rank's rows read as stored) and decode
    as they do dequantized."""
    from gguf import GGMLQuantizationType

    from tests.helpers.gguf_writer import write_gguf

    hf_model = save_family("phi3-mini", tmp_path / "hf")
    path = str(tmp_path / "phi3.gguf")
    q8 = GGMLQuantizationType.Q8_0
    write_gguf(
        path,
        hf_model,
        {f"blk.{i}.{part}": q8 for i in range(2) for part in ("attn_qkv", "ffn_up")},
        architecture="phi3",
    )
    packed, dense = LLM(path), LLM(path, quantization="none")
    layer = packed.engine.model.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "QuantColumnParallelLinear"
    assert type(layer.mlp.gate_up_proj).__name__ == "QuantColumnParallelLinear"
    ours, theirs = generate(packed, PROMPTS), generate(dense, PROMPTS)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("family", ["gemma", "gemma3-llama.cpp", "granite", "olmo2"])
def test_packed_gguf_linears_of_other_families_decode_as_dequantized(tmp_path, family):
    """Each family's GGUF linears stored as Q8_0 stay packed under ``quantization="auto"`` and
    decode the tokens the same file gives dequantized."""
    from gguf import GGMLQuantizationType

    from tests.helpers.gguf_writer import gguf_name, write_gguf

    hf_model = save_family(family, tmp_path / "hf")
    architecture = family.split("-")[0]
    linears = [name for name, p in hf_model.state_dict().items() if p.ndim == 2 and "proj" in name]
    types = {gguf_name(name, architecture).removesuffix(".weight"): GGMLQuantizationType.Q8_0 for name in linears}
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(path, hf_model, types, architecture=architecture)
    packed, dense = LLM(path), LLM(path, quantization="none")
    layer = packed.engine.model.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "QuantColumnParallelLinear"
    assert type(layer.mlp.down_proj).__name__ == "QuantRowParallelLinear"
    for a, b in zip(generate(packed, PROMPTS), generate(dense, PROMPTS)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi3-mini"])
def test_sliding_groups_hold_only_their_window(name, tmp_path):
    """Long sequences on models with sliding layers (Gemma 3: two sliding layers per global
    one; Gemma 2: alternating; Phi-3: a window on every layer): after its prompt, each
    sequence holds at most ceil(W / block) + 1 blocks in every sliding KV layer group (the
    core's own counters, every step), every block in a full group, and its output still
    equals transformers'."""
    from tests.helpers.families import WINDOW

    hf_model = save_family(name, tmp_path)
    prompts = [list(range(10, 47)), list(range(100, 160))]
    new_tokens = 40
    oracle = {tuple(prompt): hf_greedy_logprobs(hf_model, prompt, new_tokens) for prompt in prompts}
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    engine, block = llm.engine, 4
    layout = engine.runner.layout
    assert any(window is not None for window in layout.group_windows)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals, decode_steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
                continue
            prompt, generated = prompts[int(output.request_id[1:])], len(output.outputs[0].token_ids)
            if generated < 2:
                continue  # the last prefill chunk ran this step: its blocks go at the next one
            computed = len(prompt) + generated - 1
            held = engine.scheduler.held_blocks(output.request_id)
            for window, count in zip(layout.group_windows, held):
                if window is None:
                    assert count == -(-computed // block)
                else:
                    assert count <= -(-WINDOW // block) + 1, (name, output.request_id, held)
            decode_steps += 1
    assert decode_steps > 70
    assert engine.scheduler.stats().num_used_blocks == 0
    for i, prompt in enumerate(prompts):
        tokens, logprobs, gaps = oracle[tuple(prompt)]
        completion = finals[f"r{i}"].outputs[0]
        for j, token in enumerate(tokens):
            if completion.token_ids[j] != token:
                assert gaps[j] < 1e-3, f"{name}: diverged at token {j}"
                break
            assert completion.logprobs[j][token].logprob == pytest.approx(logprobs[j], abs=TOLERANCE)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-mini", "granite", "olmo2"])
def test_speculation_and_structured_outputs_run_on_the_family(name, tmp_path):
    """Model-free speculation and a draft model (the model drafting for itself, its KV in the
    target's full layer group) give plain decoding's greedy tokens; a regex constraint holds."""
    import re

    from pagedrs.sampling_params import StructuredOutputsParams

    save_family(name, tmp_path)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(10, 47))]
    settings = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]

    plain = LLM(str(tmp_path), **settings)
    expected = tokens(plain)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": 0}
    drafting = {"model": str(tmp_path), "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    for spec in (ngram, drafting):
        speculative = LLM(str(tmp_path), **settings, speculative_config=spec)
        assert tokens(speculative) == expected, spec
        stats = speculative.engine.scheduler.stats()
        assert stats.num_drafts_total > 0 and stats.num_used_blocks == 0
        if spec is drafting:  # drafting for itself: every proposal is right
            assert stats.num_accepted_tokens_total == stats.num_draft_tokens_total
    constraint = StructuredOutputsParams(regex="(w[2-9])+")
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=12, structured_outputs=constraint)
    for output in plain.generate(prompts, constrained, use_tqdm=False):
        assert re.fullmatch("(w[2-9])+", output.outputs[0].text.replace(" ", "")), output.outputs[0].text
