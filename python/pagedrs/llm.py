"""`LLM`: the offline API, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from pagedrs.config import EngineConfig
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.lora.adapter import LoRARequest
from pagedrs.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams
from pagedrs.scoring import classifier_score, cosine, pair_token_ids, pairs

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int] | dict[str, Any]
"""Text, token ids, or vLLM's prompt dicts: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``."""
Message = dict[str, str]


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """A string, a prompt dict or a non-empty list of token ids is one prompt; anything else is
    a sequence of prompts."""
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
    )


def _engine_prompt(prompt: Prompt) -> str | list[int]:
    """A prompt as the engine takes it: vLLM's ``{"prompt": text}`` and
    ``{"prompt_token_ids": ids}`` unwrapped; other keys (images, ...) are refused."""
    if not isinstance(prompt, dict):
        return prompt
    known = {"prompt", "prompt_token_ids"}
    unknown = sorted(set(prompt) - known)
    if unknown:
        raise ValueError(f"unsupported prompt keys {unknown}: a prompt dict has 'prompt' or 'prompt_token_ids'")
    if len(prompt) != 1:
        raise ValueError("a prompt dict has exactly one of 'prompt' (text) and 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError("'prompt' must be text")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, list):
        raise ValueError("'prompt_token_ids' must be a list of token ids")
    return ids


def _prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    return [_engine_prompt(prompt) for prompt in ([prompts] if _is_one_prompt(prompts) else list(prompts))]


def _is_one_conversation(messages: list[Message] | Sequence[list[Message]]) -> TypeIs[list[Message]]:
    """Messages (dicts) are one conversation; anything else is a sequence of conversations."""
    return bool(messages) and isinstance(messages[0], dict)


class LLM:
    """Generates for batches of prompts with continuous batching on the paged KV cache.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct); ``LLM("path/to/checkpoint")``
    a Hugging Face checkpoint directory or GGUF file. Keyword arguments are `EngineConfig`
    fields (``dtype``, ``kv_cache_memory``, ``max_num_batched_tokens``,
    ``tensor_parallel_size``, ...). With ``tensor_parallel_size > 1`` worker processes are
    spawned, so a script must create the `LLM` under ``if __name__ == "__main__":``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes (if any); the `LLM` cannot generate
        afterwards. Also done at interpreter exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for each prompt (text, token ids, or vLLM's prompt dicts); outputs come
        back in the order of the prompts. All prompts are validated before any is queued.
        ``lora_request``: the adapter every prompt runs with, or one (or ``None``) per prompt
        (an `LLM` built with ``enable_lora=True``)."""
        engine_prompts = _prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(engine_prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(engine_prompts):
                raise ValueError(f"{len(engine_prompts)} prompts but {len(params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters: list[LoRARequest | None] = [lora_request] * len(engine_prompts)
        else:
            adapters = list(lora_request)
            if len(adapters) != len(engine_prompts):
                raise ValueError(f"{len(engine_prompts)} prompts but {len(adapters)} LoRA requests")
        return self._run(self._add_all(engine_prompts, params, adapters), use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: the last layer's hidden states pooled (by default the
        last token's, unit length; see `PoolingParams`). Any served decoder model embeds."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise ValueError("embed takes PoolingParams with task='embed'")
        outputs = self._pool(_prompts(prompts), params, use_tqdm)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(self._pooled(o).tolist()))
            for o in outputs
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Each prompt through the model's classifier head: per label, a sigmoid (one label)
        or the softmax over the labels."""
        outputs = self._pool(_prompts(prompts), PoolingParams(task="classify"), use_tqdm)
        return [
            ClassificationRequestOutput(
                o.request_id, o.prompt_token_ids, ClassificationOutput(self._pooled(o).tolist())
            )
            for o in outputs
        ]

    def score(
        self, text_1: str | list[str], text_2: str | list[str], *, use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``score``: one text against each of several, or pairs of two equal lists
        (`pagedrs.scoring.pairs`). A classifier scores each pair as one input; any other
        model by the cosine similarity of the two texts' embeddings (`pagedrs.scoring`)."""
        text_pairs = pairs(text_1, text_2)
        if self.engine.model.score is not None:
            if self.engine.model.score.out_features != 1:  # said before any pair runs
                raise ValueError(
                    f"scoring needs a classifier with one label; this model's head has "
                    f"{self.engine.model.score.out_features}"
                )
            tokenizer = self.engine.tokenizer
            inputs: list[str | list[int]] = [pair_token_ids(tokenizer, first, second) for first, second in text_pairs]
            outputs = self._pool(inputs, PoolingParams(task="classify"), use_tqdm)
            return [
                ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(classifier_score(self._pooled(o))))
                for o in outputs
            ]
        texts = list(dict.fromkeys(text for pair in text_pairs for text in pair))
        embedded = dict(zip(texts, self._pool(list(texts), PoolingParams(), use_tqdm)))
        return [
            ScoringRequestOutput(
                f"llm-{next(self._ids)}",
                embedded[first].prompt_token_ids + embedded[second].prompt_token_ids,
                ScoringOutput(cosine(self._pooled(embedded[first]), self._pooled(embedded[second]))),
            )
            for first, second in text_pairs
        ]

    def _pool(self, prompts: list[str | list[int]], params: PoolingParams, use_tqdm: bool) -> list[RequestOutput]:
        return self._run(self._add_all(prompts, [params] * len(prompts)), use_tqdm)

    @staticmethod
    def _pooled(output: RequestOutput) -> Any:
        if output.pooled is None:
            raise RuntimeError(f"request {output.request_id} ended without a result: {output.error or 'cut short'}")
        return output.pooled

    def _add_all(
        self,
        prompts: list[str | list[int]],
        params: Sequence[SamplingParams | PoolingParams],
        adapters: Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queues every prompt, or (when one is refused) none."""
        request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for index, (request_id, prompt, param) in enumerate(zip(request_ids, prompts, params)):
                lora = adapters[index] if adapters is not None else None
                self.engine.add_request(request_id, prompt, param, lora_request=lora)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the checkpoint's chat template to one conversation or a list of them."""
        conversations = [messages] if _is_one_conversation(messages) else list(messages)
        prompts = [self.apply_chat_template(conversation, add_generation_prompt) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        # In inference mode once for every step (see pagedrs.inference_mode).
        with (
            torch.inference_mode(),
            tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm or len(request_ids) < 2) as bar,
        ):
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
