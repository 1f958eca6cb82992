"""``POST /v1/embeddings``, ``/v1/score`` and ``/v1/rerank``: pooling requests
(`pagedrs.pooling_params`) on the same engine, batches and limits as generation.

- Embeddings: OpenAI's shape (floats or base64 of little-endian float32, ``dimensions``,
  ``usage.prompt_tokens``), on any served decoder model: the last token's final hidden state,
  unit length unless ``normalize`` is false.
- Score (vLLM's shape) and rerank (Jina's / Cohere's): each pair scored as `pagedrs.scoring`
  says: by the classifier head when the model has one, else by the cosine of embeddings.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
import torch
from starlette.requests import Request

from pagedrs.outputs import RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.scoring import classifier_score, cosine, pair_token_ids, pairs
from pagedrs.server.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedrs.server.serving import APIError, Prompt, Serving, prompts_of, warn_unknown_fields


def _pooled(final: RequestOutput) -> torch.Tensor:
    if final.pooled is None:
        raise APIError(500, f"the request ended without a result ({final.error or 'cut short'})", "InternalServerError")
    return final.pooled


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # as OpenAI's: the float32 bytes, little-endian
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _usage(prompts: list[Prompt]) -> dict[str, int]:
    tokens = sum(len(prompt.token_ids) for prompt in prompts)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def pool(
    serving: Serving, prefix: str, prompts: list[Prompt], params: PoolingParams, raw_request: Request, param: str
) -> list[torch.Tensor]:
    """Each prompt's pooled result, as one run of engine requests (all queued, or none)."""
    for index, prompt in enumerate(prompts):
        # The core keeps one slot past the prompt, as for any request.
        if len(prompt.token_ids) >= serving.max_model_len:
            where = f"{param}[{index}]" if len(prompts) > 1 else param
            raise APIError(
                400,
                f"This model's maximum context length is {serving.max_model_len} tokens; {where} has "
                f"{len(prompt.token_ids)} tokens (at most {serving.max_model_len - 1} fit).",
                param=param,
            )
    run = serving.new_run(prefix, 1, prompts)
    await serving.start(run, [params] * len(prompts))
    finals = await serving.run_to_end(run, raw_request)
    return [_pooled(final) for final in finals]


async def create_embedding(serving: Serving, body: EmbeddingRequest, raw_request: Request) -> dict[str, Any]:
    warn_unknown_fields(body)
    serving.check_model(body.model, adapters=False)
    if isinstance(body.input, list) and body.input and not isinstance(body.input[0], int):
        serving.check_count(len(body.input), "input")
    prompts = await serving.tokenize(prompts_of, body.input, "input")
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    except ValueError as error:
        raise APIError(400, str(error), param="dimensions") from error
    hidden = serving.engine.pooler.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise APIError(400, f"dimensions must be at most the model's hidden size ({hidden})", param="dimensions")
    vectors = await pool(serving, "embd", prompts, params, raw_request, "input")
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": serving.served_model_name,
        "data": [
            {"object": "embedding", "index": index, "embedding": _encode(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)
        ],
        "usage": _usage(prompts),
    }


async def score_pairs(
    serving: Serving, text_pairs: list[tuple[str, str]], raw_request: Request, param: str
) -> tuple[list[float], dict[str, int]]:
    """Each pair's score (`pagedrs.scoring`), and the tokens it took."""
    serving.check_count(len(text_pairs), param)
    pooler = serving.engine.pooler
    if pooler.classify is not None:
        if pooler.num_labels != 1:  # refused before any work is queued
            raise APIError(400, f"scoring needs a classifier with one label; this model's head has {pooler.num_labels}")

        def encode_pairs(tokenizer: Any) -> list[Prompt]:
            return [Prompt(pair_token_ids(tokenizer, first, second)) for first, second in text_pairs]

        prompts = await serving.tokenize(encode_pairs)
        scores = await pool(serving, "score", prompts, PoolingParams(task="classify"), raw_request, param)
        try:
            return [classifier_score(score) for score in scores], _usage(prompts)
        except ValueError as error:
            raise APIError(400, str(error)) from error
    texts = list(dict.fromkeys(text for pair in text_pairs for text in pair))
    prompts = await serving.tokenize(prompts_of, texts, param)
    vectors = dict(zip(texts, await pool(serving, "score", prompts, PoolingParams(), raw_request, param)))
    return [cosine(vectors[first], vectors[second]) for first, second in text_pairs], _usage(prompts)


async def create_score(serving: Serving, body: ScoreRequest, raw_request: Request) -> dict[str, Any]:
    warn_unknown_fields(body)
    serving.check_model(body.model, adapters=False)
    try:
        text_pairs = pairs(body.text_1, body.text_2)
    except ValueError as error:
        raise APIError(400, str(error), param="text_1") from error
    scores, usage = await score_pairs(serving, text_pairs, raw_request, "text_2")
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": serving.served_model_name,
        "data": [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)],
        "usage": usage,
    }


def _document_text(document: str | dict[str, Any], index: int) -> str:
    if isinstance(document, str):
        return document
    text = document.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"documents[{index}] must be a string or an object with a text string", param="documents")
    return text


async def create_rerank(serving: Serving, body: RerankRequest, raw_request: Request) -> dict[str, Any]:
    warn_unknown_fields(body)
    serving.check_model(body.model, adapters=False)
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {body.top_n}", param="top_n")
    documents = [_document_text(document, index) for index, document in enumerate(body.documents)]
    if not body.query:
        raise APIError(400, "query must not be empty", param="query")
    scores, usage = await score_pairs(serving, [(body.query, text) for text in documents], raw_request, "documents")
    order = np.argsort(-np.array(scores), kind="stable").tolist()
    if body.top_n is not None:
        order = order[: body.top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": serving.served_model_name,
        "usage": {"total_tokens": usage["total_tokens"]},
        "results": results,
    }
