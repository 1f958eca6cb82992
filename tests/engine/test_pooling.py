"""Pooling requests in the engine (`PoolingParams`): ``last`` / ``mean`` / ``cls`` embeddings
equal transformers' last hidden state of the same tokens on every family's tiny checkpoint,
through chunked prefill, prefix hits and preemption, batched with generation that keeps its
greedy tokens; classifiers equal transformers' sequence classification; `LLM.embed`,
`LLM.classify`, `LLM.score` and vLLM's prompt dicts; bad parameters are refused with nothing
left behind."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedrs import LLM, LLMEngine, PoolingParams, SamplingParams
from tests.helpers.checkpoints import TINY, save_tiny_checkpoint, save_word_tokenizer, tiny_config

PREFIX = [(7 * i + 3) % 300 + 10 for i in range(40)]
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [21, 22], [(5 * i + 1) % 300 + 10 for i in range(70)], [4, 5, 6]]
# Chunked prefill of 32 tokens a step; 12 blocks of 16 tokens: the generation requests below
# outgrow them, so sequences are preempted and recomputed.
SETTINGS = dict(max_num_batched_tokens=32, max_num_seqs=6, block_size=16)


def _hf_pooled(model, prompt: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=-1)


def _run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def _budget(engine_kwargs: dict, directory: str, num_blocks: int) -> int:
    from pagedrs.memory import kv_bytes_per_token

    return num_blocks * SETTINGS["block_size"] * kv_bytes_per_token(directory, "float32", 1)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_embeddings_equal_the_last_hidden_state(tiny_checkpoint, kind):
    _, directory, hf = tiny_checkpoint
    alone = LLM(directory, kv_cache_memory="16MiB", **SETTINGS)
    expected_tokens = [
        o.outputs[0].token_ids
        for o in alone.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    ]
    engine = LLMEngine(model=directory, kv_cache_memory=_budget({}, directory, 12), **SETTINGS)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"gen-{index}", prompt, SamplingParams(max_tokens=40, temperature=0))
        engine.add_request(f"pool-{index}", prompt, PoolingParams(pooling_type=kind))
    finished = _run(engine)
    stats = engine.scheduler.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0  # the settings do both
    assert stats.num_used_blocks == 0
    for index, prompt in enumerate(PROMPTS):
        pooled = finished[f"pool-{index}"].pooled
        assert finished[f"pool-{index}"].outputs == [] and pooled.shape == (TINY["hidden_size"],)
        assert abs(float(pooled.norm()) - 1.0) < 1e-5
        similarity = torch.nn.functional.cosine_similarity(pooled, _hf_pooled(hf, prompt, kind), dim=0)
        assert float(similarity) > 0.9999, (index, kind)
        assert finished[f"gen-{index}"].outputs[0].token_ids == expected_tokens[index]


def test_dimensions_and_normalize(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="8MiB", max_num_seqs=8)
    full = llm.embed([5, 6, 7], pooling_params=PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    cut = llm.embed([5, 6, 7], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    expected = torch.nn.functional.normalize(torch.tensor(full[:8]), dim=-1)
    assert torch.allclose(torch.tensor(cut), expected, atol=1e-6)
    assert abs(float(torch.tensor(full).norm()) - 1.0) > 1e-3  # not normalized


def test_vllm_prompt_dicts(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="8MiB", max_num_seqs=8)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    by_ids = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    by_dict = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    one_dict = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    by_text = llm.generate({"prompt": "w5 w6 w7"}, greedy, use_tqdm=False)[0]
    assert by_ids == by_dict == one_dict
    assert by_text.prompt_token_ids == llm.get_tokenizer().encode("w5 w6 w7")
    embedded = llm.embed([{"prompt_token_ids": [5, 6, 7]}, "w5 w6 w7"], use_tqdm=False)
    assert embedded[0].prompt_token_ids == [5, 6, 7] and len(embedded[0].outputs.embedding) == TINY["hidden_size"]
    for bad, message in [
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
        ({"multi_modal_data": {}}, "unsupported prompt keys"),
        ({"prompt_token_ids": "5 6"}, "list of token ids"),
        ({"prompt": 5}, "must be text"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([bad], greedy, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_bad_pooling_requests_are_refused_and_leave_nothing(tiny_llama):
    engine = LLMEngine(model=tiny_llama, kv_cache_memory="8MiB", max_num_seqs=8)
    for make, message in [
        (lambda: PoolingParams(task="rerank"), "task must be"),
        (lambda: PoolingParams(pooling_type="max"), "pooling_type must be"),
        (lambda: PoolingParams(dimensions=0), "dimensions must be a positive integer"),
        (lambda: PoolingParams(dimensions=True), "dimensions must be a positive integer"),
        (lambda: PoolingParams(task="classify", dimensions=4), "embeddings only"),
        (lambda: PoolingParams(normalize="yes"), "normalize must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            make()
    for prompt, params, message in [
        ([5, 6], PoolingParams(dimensions=TINY["hidden_size"] + 1), "at most the model's hidden size"),
        ([5, 6], PoolingParams(task="classify"), "no classifier head"),
        ([], PoolingParams(), "the prompt is empty"),
        ([5, TINY["vocab_size"]], PoolingParams(), "prompt token ids must be integers"),
        ([5, True], PoolingParams(), "prompt token ids must be integers"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="SamplingParams or PoolingParams"):
        engine.add_request("bad", [5, 6], {"max_tokens": 3})
    assert not engine.has_unfinished_requests() and engine.scheduler.stats().num_waiting == 0
    engine.add_request("good", [5, 6], PoolingParams())  # the id was never taken
    assert _run(engine)["good"].pooled is not None


def test_a_speculative_engine_refuses_pooling(tiny_llama):
    engine = LLMEngine(
        model=tiny_llama,
        kv_cache_memory="8MiB",
        max_num_seqs=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(ValueError, match="without speculative decoding"):
        engine.add_request("p", [5, 6], PoolingParams())


# -- classifiers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-classifier-3")
    torch.manual_seed(5)
    config = tiny_config("qwen3")
    config.num_labels = 3
    config.pad_token_id = TINY["vocab_size"] - 1
    model = transformers.Qwen3ForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return str(directory), model


def test_classify_equals_the_sequence_classifier(classifier):
    directory, hf = classifier
    llm = LLM(directory, kv_cache_memory="8MiB", max_num_seqs=8, max_num_batched_tokens=32)
    outputs = llm.classify([prompt for prompt in PROMPTS], use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = torch.softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=1e-5)
    with pytest.raises(ValueError, match="one label"):
        llm.score("w5", ["w6"], use_tqdm=False)  # three labels: no single score
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([5, 6], use_tqdm=False)
    assert llm.engine.scheduler.stats().num_used_blocks == 0


def test_a_causal_model_scores_through_classifier_from_token(tmp_path):
    """Qwen3-Reranker's recipe: P("yes") over {"no", "yes"} from the last position's logits."""
    hf = save_tiny_checkpoint("qwen3", tmp_path)
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["w7", "w9"],  # the tiny tokenizer's "no" and "yes"
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(str(tmp_path), kv_cache_memory="8MiB", max_num_seqs=8, hf_overrides=overrides)
    tokenizer = llm.get_tokenizer()
    documents = ["w8 w9", "w4", "w2 w3 w5"]
    scores = llm.score("w5 w6", documents, use_tqdm=False)
    for document, score in zip(documents, scores):
        ids = tokenizer("w5 w6", document)["input_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        assert score.outputs.score == pytest.approx(float(torch.softmax(logits[[7, 9]], dim=-1)[1]), abs=1e-5)
    # It still generates: the head is the model's own.
    assert len(llm.generate([5, 6], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    for bad, message in [
        ({"classifier_from_token": "yes"}, "non-empty list"),
        ({"classifier_from_token": ["no", "yes", "maybe"], "is_original_qwen3_reranker": True}, "two tokens"),
        ({"classifier_from_token": ["w7", "not-a-token"]}, "not a token"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), kv_cache_memory="8MiB", hf_overrides=bad)


def test_score_by_embeddings_is_their_cosine(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="8MiB", max_num_seqs=8)
    scores = llm.score("w5 w6", ["w7 w8", "w5 w6"], use_tqdm=False)
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(["w5 w6", "w7 w8"], use_tqdm=False)]
    assert scores[0].outputs.score == pytest.approx(float(vectors[0] @ vectors[1]), abs=1e-5)
    assert scores[1].outputs.score == pytest.approx(1.0, abs=1e-5)
