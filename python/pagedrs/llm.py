"""`LLM`: the offline API, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedrs.config import EngineConfig
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.outputs import RequestOutput
from pagedrs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int]
Message = dict[str, str]


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """A string or a non-empty list of token ids is one prompt; anything else is a sequence of prompts."""
    return isinstance(prompts, str) or (
        isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
    )


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
    ) -> list[RequestOutput]:
        """Generates for each prompt (text, or a list of token ids); outputs come back in the
        order of the prompts. All prompts are validated before any is queued."""
        prompts = [prompts] if _is_one_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, param in zip(request_ids, prompts, params):
                self.engine.add_request(request_id, prompt, param)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

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
        with tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm or len(request_ids) < 2) as bar:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
