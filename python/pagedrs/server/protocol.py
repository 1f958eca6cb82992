"""Request bodies of the OpenAI-compatible API, with vLLM's extensions.

Types are strict (``"5"`` is not an integer) so a client's mistake is a 400, not a guess.
Fields we don't know are ignored, as OpenAI and vLLM do, and logged. Value ranges are
checked once, by `SamplingParams`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

_NOT_TEXT = {int, float, bool, type(None)}


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
        # (token ids: millions of numbers, each checked at C speed, not one call apiece)
        if set(map(type, value)) <= _NOT_TEXT:
            return
        for index, item in enumerate(value):
            _check_unicode(f"{where}[{index}]", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(f"{where}.{key}", key)
            _check_unicode(f"{where}.{key}", item)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a template gets the text as it came


def _prompt_kind(value: Any) -> str:
    """Which form a prompt takes, read off its first element: pydantic then validates that
    form alone. (Trying each form of the union in turn validated a 3-million-id prompt four
    ways: 3 s on the event loop, against 0.1 s.)"""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "token_lists"
    return "tokens"


Prompt = Annotated[
    Union[
        Annotated[str, Tag("text")],
        Annotated[list[str], Tag("texts")],
        Annotated[list[int], Tag("tokens")],
        Annotated[list[list[int]], Tag("token_lists")],
    ],
    Discriminator(_prompt_kind),
]
"""A text, texts, token ids or lists of token ids (OpenAI's ``prompt`` and ``input``)."""


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


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` request field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older names for ``structured_outputs`` fields."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Generation):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Top tokens per position (the sampled one always comes with them)."""


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCallBody(_Body):
    name: str
    arguments: str = "{}"
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCallBody(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A ``tool`` message: which call this is the result of."""

    def for_template(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            entry["name"] = self.name
        return entry

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionBody(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments."""
    strict: bool | None = None


class ToolBody(_Body):
    type: Literal["function"]
    function: FunctionBody


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: an assistant's tool calls with their
        arguments as objects (templates serialize them), a tool result with its call's id."""
        return [message.for_template() for message in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    """OpenAI's ``/v1/embeddings`` body (vLLM's ``normalize`` too)."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Keep the first ``dimensions`` features (Matryoshka), then normalize."""
    normalize: bool = True
    user: str | None = None


class ScoreRequest(_Body):
    """vLLM's ``/v1/score`` body: one text against several, or two lists pairwise."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Body):
    """The Jina / Cohere ``/v1/rerank`` body."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    """Texts, or Cohere's ``{"text": ...}`` objects."""
    top_n: int | None = None
    """Keep the best ``top_n`` (default: all)."""
    return_documents: bool = True


class LoadLoRAAdapterRequest(_Body):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    lora_name: str
