"""``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` on a real server, through the official
`openai` client where it has the call: embeddings equal transformers' last hidden state of the
same tokens, scores equal a transformers sequence classifier's, embeddings and generation
share one engine without changing each other's results, and every bad body is a 400 that
leaves the engine idle."""

from __future__ import annotations

import base64
import concurrent.futures

import numpy as np
import openai
import pytest
import torch

from tests.helpers.checkpoints import TINY, save_word_tokenizer, tiny_config
from tests.helpers.servers import InProcessServer, engine_idle, wait_for

TEXTS = ["The quick brown fox", "jumps over the lazy dog.", "Paged attention keeps the KV cache in blocks."]


@pytest.fixture(scope="module")
def server(tiny_smol):
    server = InProcessServer(
        [tiny_smol, "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "16MiB"]
        + ["--max-num-batched-tokens", "64", "--max-num-seqs", "16"]
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_model(tiny_smol):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(tiny_smol).eval(), AutoTokenizer.from_pretrained(tiny_smol)


def _hf_embedding(hf_model, token_ids: list[int]) -> torch.Tensor:
    model, _ = hf_model
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


def _assert_same_direction(ours, theirs: torch.Tensor) -> None:
    ours = torch.tensor(ours, dtype=torch.float32)
    assert abs(float(ours.norm()) - 1.0) < 1e-5
    assert float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0)) > 0.9999


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embeddings_equal_the_last_hidden_state(client, hf_model, server, encoding_format):
    tokenizer = hf_model[1]
    response = client.embeddings.create(model=_model(client), input=TEXTS, encoding_format=encoding_format)
    assert [item.index for item in response.data] == [0, 1, 2]
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    for item, ids in zip(response.data, token_ids):
        embedding = item.embedding
        if encoding_format == "base64":  # the client leaves base64 as it came
            embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
        assert len(embedding) == TINY["hidden_size"]
        _assert_same_direction(embedding, _hf_embedding(hf_model, ids))
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, token_ids))
    assert wait_for(lambda: engine_idle(server))


def test_embeddings_of_token_ids_and_the_client_default(client, hf_model):
    ids = [[5, 6, 7, 8], [9, 10]]
    by_ids = client.embeddings.create(model=_model(client), input=ids)  # the client asks for base64 itself
    for item, prompt in zip(by_ids.data, ids):
        _assert_same_direction(item.embedding, _hf_embedding(hf_model, prompt))
    one = client.embeddings.create(model=_model(client), input=ids[0], encoding_format="float")
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)


def test_matryoshka_dimensions_cut_then_normalize(client, hf_model):
    tokenizer = hf_model[1]
    response = client.embeddings.create(model=_model(client), input=TEXTS[0], dimensions=16, encoding_format="float")
    (item,) = response.data
    model, _ = hf_model
    with torch.no_grad():
        hidden = model(torch.tensor([tokenizer.encode(TEXTS[0])])).last_hidden_state[0, -1, :16]
    _assert_same_direction(item.embedding, torch.nn.functional.normalize(hidden, dim=-1))


def test_embeddings_and_generation_on_one_instance_match_alone(client, server):
    model = _model(client)

    def generate(index: int) -> str:
        reply = client.completions.create(model=model, prompt=TEXTS[index % 3], max_tokens=12, temperature=0)
        return reply.choices[0].text

    def embed(index: int) -> list[float]:
        return client.embeddings.create(model=model, input=TEXTS[index % 3], encoding_format="float").data[0].embedding

    alone_text = [generate(i) for i in range(3)]
    alone_vectors = [embed(i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = [pool.submit(generate, i) for i in range(6)]
        vectors = [pool.submit(embed, i) for i in range(6)]
        for i, future in enumerate(texts):
            assert future.result() == alone_text[i % 3]
        for i, future in enumerate(vectors):
            assert np.allclose(future.result(), alone_vectors[i % 3], atol=1e-5)
    assert wait_for(lambda: engine_idle(server))


def test_scoring_an_embedding_model_is_the_cosine_of_embeddings(server, client):
    status, body = server.http.request("POST", "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert status == 200, body
    vectors = client.embeddings.create(model=_model(client), input=TEXTS, encoding_format="float").data
    for item, other in zip(body["data"], vectors[1:]):
        expected = float(np.dot(vectors[0].embedding, other.embedding))
        assert item["score"] == pytest.approx(expected, abs=1e-5)


BAD_EMBEDDINGS = [
    ({"input": ""}, "input must not be empty"),
    ({"input": []}, "input must not be empty"),
    ({"input": [[]]}, "input must not be empty"),
    ({"input": [5, 10**9]}, "prompt token ids must be integers"),
    ({"input": [-1]}, "prompt token ids must be integers"),
    ({"input": "hi", "dimensions": 0}, "dimensions must be a positive integer"),
    ({"input": "hi", "dimensions": 65}, "dimensions must be at most"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 5}, "input"),
    ({"input": "w " * 300}, "maximum context length"),
    ({"input": "hi", "model": "other"}, "does not exist"),
    ({"input": ["w5"] * 513}, "queues at most 512"),  # refused before tokenizing
]


@pytest.mark.parametrize(("body", "message"), BAD_EMBEDDINGS)
def test_bad_embedding_bodies_are_4xx_and_leave_the_engine_idle(server, body, message):
    status, reply = server.http.request("POST", "/v1/embeddings", body)
    assert 400 <= status < 500, reply
    assert message in reply["error"]["message"]
    assert wait_for(lambda: engine_idle(server))


def test_pooling_routes_are_counted_in_the_metrics(server, client):
    client.embeddings.create(model=_model(client), input="count me", encoding_format="float")
    status, text = server.http.request("GET", "/metrics")
    assert status == 200
    assert "pagedrs:api_requests_total{model_name=" in text
    assert 'route="/v1/embeddings",status="200"' in text
    assert 'route="/v1/embeddings",status="400"' in text


def _model(client) -> str:
    return client.models.list().data[0].id


# -- a sequence classifier: score and rerank ---------------------------------------------------

PAIRS_QUERY = "w5 w6 w7"
DOCUMENTS = ["w8 w9", "w4 w5 w6", "w7", "w2 w3 w4 w5"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("qwen3-classifier")
    torch.manual_seed(3)
    config = tiny_config("qwen3")
    config.num_labels = 1
    config.pad_token_id = TINY["vocab_size"] - 1  # never in the inputs: HF pools the true last token
    model = transformers.Qwen3ForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.mul_(20)  # spread the scores
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return str(directory), model


@pytest.fixture(scope="module")
def score_server(classifier):
    server = InProcessServer([classifier[0], "--device", "cpu", "--max-model-len", "128", "--kv-cache-memory", "8MiB"])
    yield server
    server.close()


def _hf_scores(classifier, first: str, seconds: list[str]) -> list[float]:
    from transformers import AutoTokenizer

    directory, model = classifier
    tokenizer = AutoTokenizer.from_pretrained(directory)
    scores = []
    for second in seconds:
        ids = tokenizer(first, second)["input_ids"]
        with torch.no_grad():
            scores.append(float(torch.sigmoid(model(torch.tensor([ids])).logits[0, 0])))
    return scores


def test_score_one_to_many_and_pairwise_equal_the_classifier(score_server, classifier):
    expected = _hf_scores(classifier, PAIRS_QUERY, DOCUMENTS)
    status, body = score_server.http.request("POST", "/v1/score", {"text_1": PAIRS_QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    assert [item["index"] for item in body["data"]] == list(range(len(DOCUMENTS)))
    assert [item["score"] for item in body["data"]] == pytest.approx(expected, abs=1e-5)
    assert len(set(round(score, 3) for score in expected)) > 1  # the test can tell documents apart
    pairwise = {"text_1": [PAIRS_QUERY] * 2, "text_2": DOCUMENTS[:2]}
    status, body = score_server.http.request("POST", "/score", pairwise)
    assert status == 200
    assert [item["score"] for item in body["data"]] == pytest.approx(expected[:2], abs=1e-5)


def test_rerank_sorts_by_relevance_with_top_n(score_server, classifier):
    expected = _hf_scores(classifier, PAIRS_QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    status, body = score_server.http.request(
        "POST", "/v1/rerank", {"query": PAIRS_QUERY, "documents": DOCUMENTS, "top_n": 2}
    )
    assert status == 200, body
    assert [result["index"] for result in body["results"]] == order[:2]
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    cohere = {"query": PAIRS_QUERY, "documents": [{"text": d} for d in DOCUMENTS], "return_documents": False}
    status, body = score_server.http.request("POST", "/v2/rerank", cohere)
    assert status == 200
    assert [result["index"] for result in body["results"]] == order
    assert "document" not in body["results"][0]
    assert body["usage"]["total_tokens"] > 0


BAD_SCORES = [
    ("/v1/score", {"text_1": ["w5", "w6"], "text_2": ["w7"]}, "give one text_1"),
    ("/v1/score", {"text_1": [], "text_2": ["w7"]}, "text_1 is empty"),
    ("/v1/score", {"text_1": "w5"}, "text_2"),
    ("/v1/rerank", {"query": "w5", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"], "top_n": 0}, "top_n must be at least 1"),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"] * 513}, "queues at most 512"),
    ("/v1/rerank", {"query": "w5", "documents": [{"title": "no text"}]}, "documents[0]"),
    ("/v1/rerank", {"query": "", "documents": ["w6"]}, "query must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}, "sequence classifier"),
    ("/v1/completions", {"prompt": "w5"}, "sequence classifier"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD_SCORES)
def test_bad_score_bodies_are_4xx_and_leave_the_engine_idle(score_server, path, body, message):
    status, reply = score_server.http.request("POST", path, body)
    assert 400 <= status < 500, reply
    assert message in reply["error"]["message"]
    assert wait_for(lambda: engine_idle(score_server))


def test_a_keyed_server_guards_the_aliases_and_refuses_multi_label_scores_up_front(tmp_path):
    """``/score`` and ``/rerank`` run the model like ``/v1`` does, so they need the key too; a
    head of several labels gives no score, which is said before anything is queued."""
    import transformers

    torch.manual_seed(4)
    config = tiny_config("qwen3")
    config.num_labels = 3
    config.pad_token_id = TINY["vocab_size"] - 1
    transformers.Qwen3ForSequenceClassification(config).save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, TINY["vocab_size"])
    server = InProcessServer(
        [str(tmp_path), "--device", "cpu", "--max-model-len", "64", "--kv-cache-memory", "4MiB", "--api-key", "k"]
    )
    try:
        pair = {"text_1": "w5", "text_2": ["w6", "w7"]}
        for path, body in [("/score", pair), ("/rerank", {"query": "w5", "documents": ["w6"]}), ("/v2/rerank", {})]:
            status, reply = server.http.request("POST", path, body)
            assert status == 401, (path, reply)
        status, reply = server.http.request("POST", "/v1/score", pair, headers={"Authorization": "Bearer k"})
        assert status == 400 and "one label" in reply["error"]["message"], reply
        assert server.engine.engine.scheduler.stats().num_prefill_tokens_total == 0  # nothing ran
    finally:
        server.close()
