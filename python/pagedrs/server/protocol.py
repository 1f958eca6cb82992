"""Request bodies of the OpenAI-compatible API, with vLLM's extensions.

Types are strict (``"5"`` is not an integer) so a client's mistake is a 400, not a guess.
Fields we don't know are ignored, as OpenAI and vLLM do, and logged. Value ranges are
checked once, by `SamplingParams`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _check_unicode(where: str, value: Any) -> None:
    """JSON escapes can spell lone surrogates (``"\\ud800"``), which are not text: no
    tokenizer or encoder takes them."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"{where} is not valid Unicode (a lone surrogate at {error.start})") from None
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(f"{where}[{index}]", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(f"{where}.{key}", key)
            _check_unicode(f"{where}.{key}", item)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _text_is_unicode(self) -> _Body:
        for name, value in self:  # nested bodies have checked themselves
            _check_unicode(name, value)
        return self


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Generation(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    """Requests share cached prefix blocks only with requests that have the same salt."""
    priority: int = 0
    """Lower runs first; only with ``--scheduling-policy priority``."""


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Top tokens per position (the sampled one always comes with them)."""


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
