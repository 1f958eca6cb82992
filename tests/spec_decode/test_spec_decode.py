"""Speculative decoding: greedy output identical with and without it for every method (n-gram,
suffix, draft model), through preemption, chunked prefill, prefix hits, stop strings, max_tokens
inside an accepted run and n > 1; the rejection rule keeps the target distribution exactly
(chi-square against the plain sampler); bad settings are refused; the server serves it and
exports vLLM's metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.sample import Sampler, SamplingRow
from pagedrs.spec_decode import SpeculativeConfig
from pagedrs.spec_decode.verify import filtered_probs, rejection_sample, uniforms
from tests.helpers.checkpoints import TINY, save_word_tokenizer
from tests.helpers.servers import start_server

# Never stepping aside (the CPU default does at 4 sequences): the tests run batches.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 0}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5, "disable_by_batch_size": 0}

# Prompts whose continuations repeat (a random model loops, and copies): proposals get accepted.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [9, 10, 11, 9, 10, 11, 9, 10],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 20, 21, 22],
    [40, 41, 40, 41, 40],
]


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[list[int]]]:
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [[choice.token_ids for choice in output.outputs] for output in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.scheduler.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0


def engine_settings(**overrides):
    # A tiny cache (preemption), small steps (chunked prefill) and the prefix cache on.
    settings = dict(kv_cache_memory=24 * 1024, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    return {**settings, **overrides}


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_model_free_speculation_gives_the_greedy_tokens_of_plain_decoding(tiny_checkpoint, spec):
    _, directory, _ = tiny_checkpoint
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    plain = LLM(directory, **engine_settings())
    expected = generate(plain, params) + generate(plain, params)  # the second round hits the prefix cache
    speculative = LLM(directory, **engine_settings(speculative_config=spec))
    got = generate(speculative, params) + generate(speculative, params)
    assert got == expected
    stats = speculative.engine.scheduler.stats()
    assert stats.num_drafts_total > 0 and stats.num_accepted_tokens_total > 0, stats
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0, "the cache was never tight or hit"
    assert_all_blocks_free(speculative)


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory, tiny_llama) -> str:
    """A second tiny Llama (other weights, same tokenizer): a draft that is often wrong."""
    import transformers

    torch.manual_seed(99)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1})).eval()
    directory = tmp_path_factory.mktemp("draft-llama")
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return str(directory)


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_a_draft_model_gives_the_greedy_tokens_of_plain_decoding(tiny_llama, other_llama, draft):
    model = tiny_llama if draft == "itself" else other_llama
    spec = {"model": model, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    expected = generate(LLM(tiny_llama, **engine_settings()), params)
    # The draft's KV shares the blocks: the same number of blocks takes more memory.
    memory = 24 * 1024 * (2 if draft == "itself" else 3) // (1 if draft == "itself" else 2)
    speculative = LLM(tiny_llama, **engine_settings(kv_cache_memory=memory, speculative_config=spec))
    assert speculative.engine.scheduler.num_blocks == LLM(tiny_llama, **engine_settings()).engine.scheduler.num_blocks
    assert generate(speculative, params) == expected
    stats = speculative.engine.scheduler.stats()
    assert stats.num_drafts_total > 0, stats
    if draft == "itself":  # the target drafting for itself is always right
        assert stats.num_accepted_tokens_total == stats.num_draft_tokens_total
    assert stats.num_preemptions_total > 0
    assert_all_blocks_free(speculative)


@pytest.mark.slow  # tensor-parallel ranks
def test_tensor_parallel_ranks_verify_proposals_as_one(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = generate(LLM(tiny_llama, kv_cache_memory="4MiB"), params)
    with LLM(tiny_llama, kv_cache_memory="4MiB", tensor_parallel_size=2, speculative_config=NGRAM) as parallel:
        assert generate(parallel, params) == expected
        assert parallel.engine.scheduler.stats().num_accepted_tokens_total > 0


def test_max_tokens_and_stop_strings_land_inside_accepted_runs(tiny_llama):
    plain = LLM(tiny_llama, kv_cache_memory="4MiB")
    speculative = LLM(tiny_llama, kv_cache_memory="4MiB", speculative_config=NGRAM)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = plain.generate([PROMPTS[1]], long, use_tqdm=False)[0].outputs[0].text
    words = text.split()
    # A stop string on a word deep in the output, and every max_tokens up to 40.
    stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[" ".join(words[17:19])])
    for params in [stop] + [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 41, 3)]:
        want = plain.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
        got = speculative.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert speculative.engine.scheduler.stats().num_accepted_tokens_total > 0
    assert_all_blocks_free(speculative)


@pytest.mark.slow  # the default model: over 10 s
def test_the_default_model_copies_with_fewer_steps_and_the_same_tokens(default_llm):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    prompt = f"Repeat the following text exactly:\n{text}\nRepeated text:\n"
    params = SamplingParams(temperature=0, max_tokens=48)
    expected = default_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    for spec in (NGRAM, SUFFIX):
        speculative = LLM(kv_cache_memory="256MiB", speculative_config=spec)
        got = speculative.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected
        stats = speculative.engine.scheduler.stats()
        # Most of the copy is proposed and accepted: far fewer steps than tokens.
        assert stats.num_accepted_tokens_total >= len(expected) // 2, stats
        speculative.shutdown()


def test_sampled_speculation_reports_the_logprobs_of_the_kept_tokens(tiny_llama):
    spec = {**NGRAM, "prompt_lookup_min": 1}  # sampled text repeats less
    speculative = LLM(tiny_llama, kv_cache_memory="4MiB", speculative_config=spec)
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=30, logprobs=2, ignore_eos=True)
    output = speculative.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 30 and speculative.engine.scheduler.stats().num_drafts_total > 0
    raw = LLM(tiny_llama, kv_cache_memory="4MiB")
    # The same tokens scored by a plain engine (prompt logprobs of prompt + output) agree.
    scored = raw.generate(
        [PROMPTS[0] + output.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0].prompt_logprobs[len(PROMPTS[0]) :]
    for token, entry, reference in zip(output.token_ids, output.logprobs, scored):
        assert entry[token].logprob == pytest.approx(reference[token].logprob, abs=1e-4)


def test_seeded_sampled_requests_do_not_speculate_and_stay_reproducible(tiny_llama):
    speculative = LLM(tiny_llama, kv_cache_memory="4MiB", speculative_config={**NGRAM, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0.7, max_tokens=20, seed=5, ignore_eos=True)
    alone = speculative.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = speculative.generate([PROMPTS[0], *PROMPTS[1:]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    assert speculative.engine.scheduler.stats().num_drafts_total == 0


def test_requests_with_rules_the_verifier_does_not_cover_do_not_speculate(tiny_llama):
    speculative = LLM(tiny_llama, kv_cache_memory="4MiB", speculative_config=NGRAM)
    penalized = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    expected = LLM(tiny_llama, kv_cache_memory="4MiB").generate([PROMPTS[0]], penalized, use_tqdm=False)
    got = speculative.generate([PROMPTS[0]], penalized, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert speculative.engine.scheduler.stats().num_drafts_total == 0


def test_speculation_steps_aside_in_a_batch_at_the_disable_size(tiny_llama):
    spec = {**NGRAM, "disable_by_batch_size": 2}
    speculative = LLM(tiny_llama, kv_cache_memory="4MiB", max_num_seqs=4, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    speculative.generate(PROMPTS, params, use_tqdm=False)  # four at once: never below 2 until the end
    batch_drafts = speculative.engine.scheduler.stats().num_drafts_total
    speculative.generate([PROMPTS[0]], params, use_tqdm=False)
    alone = speculative.engine.scheduler.stats().num_drafts_total - batch_drafts
    assert alone > 0 and batch_drafts < alone


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown speculative config keys: typo"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 300}, "at most 255"),
        ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2}, r"\[0, 1\]"),
        ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": 0}, "positive"),
    ],
)
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_prompt_lookup_defaults_follow_vllm():
    def lookup(**keys):
        return SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **keys}).lookup_range()

    assert lookup() == (5, 5)
    assert lookup(prompt_lookup_max=3) == (3, 3)
    assert lookup(prompt_lookup_min=2) == (2, 2)
    assert lookup(prompt_lookup_min=2, prompt_lookup_max=4) == (2, 4)


def test_parse_fills_in_the_lookup_range_the_core_reads():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    given = SpeculativeConfig(method="suffix", num_speculative_tokens=2)
    assert SpeculativeConfig.parse(given).prompt_lookup_min == 5


def test_a_failing_draft_model_fails_its_batch_and_the_engine_goes_on(tiny_llama):
    spec = {"model": tiny_llama, "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    llm = LLM(tiny_llama, kv_cache_memory="4MiB", speculative_config=spec)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = generate(llm, params, PROMPTS[:1])
    forward = engine.drafter.runner.forward
    calls = {"n": 0}

    def failing(arrays):
        calls["n"] += 1
        if calls["n"] == 3:  # a step with proposals
            raise RuntimeError("draft model failed")
        return forward(arrays)

    engine.drafter.runner.forward = failing
    failed = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert failed.error is not None and "draft model failed" in failed.error
    engine.drafter.runner.forward = forward
    assert_all_blocks_free(llm)
    assert generate(llm, params, PROMPTS[:1]) == expected


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    import transformers

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "vocab_size": 256})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            tiny_llama, kv_cache_memory="4MiB", speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2}
        )


# -- the rejection rule keeps the target distribution -------------------------------------


def _two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic of two samples' counts over the bins either uses, and its degrees
    of freedom."""
    bins = (a + b) > 0
    a, b = a[bins].astype(float), b[bins].astype(float)
    scale_a, scale_b = np.sqrt(b.sum() / a.sum()), np.sqrt(a.sum() / b.sum())
    return float((((scale_a * a - scale_b * b) ** 2) / (a + b)).sum()), int(bins.sum()) - 1


@pytest.mark.slow  # many draws: over 10 s
@pytest.mark.parametrize("draft", ["point", "model"])
def test_rejection_sampling_matches_plain_sampling_chi_square(tiny_llama, other_llama, draft):
    """The tiny model's next-token distribution after a prompt, under temperature, top-k and
    top-p: 200k tokens emitted by verification (proposals from a fixed token, or drawn from a
    second model's distribution) against 200k from the plain sampler."""
    from transformers import AutoModelForCausalLM

    def next_logits(directory: str) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            return model(torch.tensor([PROMPTS[2]])).logits[0, -1] * 4  # sharpen the flat random head

    target_logits = next_logits(tiny_llama)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    num_draws, vocab = 200_000, target_logits.shape[-1]
    sampler = Sampler(vocab, seed=3)
    rows = [SamplingRow(params, None)] * num_draws
    logits = target_logits.expand(num_draws, -1).contiguous()
    plain = sampler(logits.clone(), rows).token_ids
    target = filtered_probs(target_logits.unsqueeze(0), [params]).expand(num_draws, -1)
    if draft == "point":  # n-gram: always the second most likely token
        drafts = torch.full((num_draws,), int(target[0].argsort(descending=True)[1]))
        q = None
    else:
        q_row = filtered_probs(next_logits(other_llama).unsqueeze(0), [params])
        generator = torch.Generator().manual_seed(8)
        drafts = torch.multinomial(q_row.expand(num_draws, -1), 1, replacement=True, generator=generator).squeeze(1)
        q = q_row.expand(num_draws, -1)
    verified = rejection_sample(target, drafts, q, uniforms(sampler, rows[:1], 2 * num_draws).view(num_draws, 2))
    accepted = (verified == drafts).float().mean().item()
    assert 0.02 < accepted < 0.98, accepted  # both branches of the rule are exercised
    counts_plain = np.bincount(plain, minlength=vocab)
    counts_verified = np.bincount(verified.numpy(), minlength=vocab)
    statistic, dof = _two_sample_chi_square(counts_plain, counts_verified)
    assert statistic < _chi_square_quantile(dof), (statistic, dof)
    # And the test has the power to see a 2% shift of mass: move 2% from the top token.
    shifted = counts_verified.copy()
    top, other = np.argsort(counts_verified)[-1], np.argsort(counts_verified)[-2]
    moved = int(0.02 * num_draws)
    shifted[top] -= moved
    shifted[other] += moved
    assert _two_sample_chi_square(counts_plain, shifted)[0] > _chi_square_quantile(dof)


@pytest.fixture(scope="module")
def sharp_pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny Llama whose next-token distributions are peaked (a scaled head), so that a few
    thousand draws fill the bins of the first two tokens; and its draft: the same weights with a
    flatter head (close to the target, never equal: proposals are often but not always right)."""
    import transformers

    directories = []
    for name, scale in (("sharp-llama", 6.0), ("flatter-llama", 1.5)):
        torch.manual_seed(21)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        save_word_tokenizer(directory, TINY["vocab_size"])
        directories.append(str(directory))
    return directories[0], directories[1]


def _chi_square_quantile(dof: int, z: float = 3.09) -> float:
    """The chi-square(dof) quantile at standard-normal ``z`` (3.09: 99.9%), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.slow  # many draws: over 10 s
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_the_engine_samples_the_same_joint_distribution_with_speculation(sharp_pair, spec):
    """End to end through the engine: the joint distribution of the first two tokens (the
    second is verified against a proposal) with and without speculation, chi-square at 99.9%.
    (A rule that accepts with probability min(1, 1.5 p / q) fails it.)"""
    target, draft = sharp_pair
    config = (
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "disable_by_batch_size": 0}
        if spec == "ngram"
        else {"model": draft, "num_speculative_tokens": 2, "disable_by_batch_size": 0}
    )
    plain_llm = LLM(target, kv_cache_memory="8MiB", max_num_seqs=64, seed=1)
    # A prompt that already holds the model's likely continuation, so that n-gram proposals
    # are often right (and often wrong).
    start = [5, 6, 7, 8]
    greedy = plain_llm.generate([start], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    prompt = start + greedy[0].outputs[0].token_ids + start
    # The second token is verified against a proposal (the third, not counted, is the bonus).
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    num_draws = 12000

    def joint(llm: LLM) -> dict[tuple[int, int], int]:
        counts: dict[tuple[int, int], int] = {}
        for output in llm.generate([prompt] * num_draws, params, use_tqdm=False):
            key = tuple(output.outputs[0].token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
        return counts

    plain = joint(plain_llm)
    speculative_llm = LLM(target, kv_cache_memory="8MiB", max_num_seqs=64, seed=2, speculative_config=config)
    speculative = joint(speculative_llm)
    stats = speculative_llm.engine.scheduler.stats()
    acceptance = stats.num_accepted_tokens_total / max(stats.num_draft_tokens_total, 1)
    assert stats.num_drafts_total > num_draws // 4 and 0.05 < acceptance < 0.97, (stats.num_drafts_total, acceptance)
    keys = sorted(set(plain) | set(speculative))
    a = np.array([plain.get(key, 0) for key in keys])
    b = np.array([speculative.get(key, 0) for key in keys])
    # Pool the rare pairs (fewer than 20 draws in both together) into one bin.
    rare = (a + b) < 20
    a = np.append(a[~rare], a[rare].sum())
    b = np.append(b[~rare], b[rare].sum())
    statistic, dof = _two_sample_chi_square(a, b)
    assert statistic < _chi_square_quantile(dof), (statistic, dof)


def test_the_gpu_checks_speculative_step_runs_on_the_cpu():
    from benches import gpu_check

    gpu_check.rows.clear()
    gpu_check.speculative_decoding("cpu")
    assert [result for _, result, _ in gpu_check.rows] == ["ok"] * 4, gpu_check.rows


# -- the server ---------------------------------------------------------------------------


@pytest.mark.slow  # a server process
def test_the_server_speculates_and_exports_vllm_metrics(tiny_smol, tmp_path):
    question = [{"role": "user", "content": "Say a b c a b c a b c a b c"}]
    expected = LLM(tiny_smol, kv_cache_memory="4MiB").chat(
        question, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
    )[0]
    args = [tiny_smol, "--kv-cache-memory", "4MiB", "--max-model-len", "256", "--log-level", "warning"]
    spec = {"model": tiny_smol, "num_speculative_tokens": 3}  # drafting for itself: always accepted
    server = start_server([*args, "--speculative-config", json.dumps(spec)], str(tmp_path / "server.log"))
    try:
        assert server.stream_chat(tiny_smol, question, max_tokens=24) == expected.outputs[0].text
        info = server.request("GET", "/server_info")[1]["speculative_config"]
        assert info["method"] == "draft_model" and info["num_speculative_tokens"] == 3
        assert info["disable_by_batch_size"] == 4  # the CPU default, filled in
        metrics = server.metrics()
        assert metrics["pagedrs:spec_decode_num_drafts_total"] > 0
        accepted = metrics["pagedrs:spec_decode_num_accepted_tokens_total"]
        assert accepted == metrics["pagedrs:spec_decode_num_draft_tokens_total"] > 0
        assert "pagedrs:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


@pytest.mark.slow  # a server process
def test_the_server_refuses_a_bad_speculative_config(tiny_smol, tmp_path):
    args = [tiny_smol, "--kv-cache-memory", "4MiB", "--log-level", "warning", "--speculative-config", "{bad"]
    with pytest.raises(RuntimeError, match="speculative config is not valid JSON") as error:
        start_server(args, str(tmp_path / "server.log"), timeout=60)
    assert "Traceback" not in str(error.value)
