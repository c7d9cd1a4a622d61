"""OpenAI request and response bodies (the subset kvserve serves), validated by pydantic.

Fields that multiply work are capped here, before anything is tokenized. A field kvserve
does not serve is refused with a 400 that names it, never silently dropped; the few that
change nothing about the output (``user``, ``metadata``, ``store``...) are accepted. Known
fields are typed strictly.

Example:
    >>> r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stop="x")
    >>> (r.stop_list(), r.stream, r.requested_max_tokens())
    (('x',), False, None)
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # chat; legacy completions allow 5
MAX_CHOICES = 128  # a schema bound; the engine's batch size bounds n further

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=1 << 20)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
Stop = Union[str, list[str], None]


class _Body(BaseModel):
    # strict: a string, bool or float is never coerced into an int field ("5", true, 2.0 are
    # 400s, as in OpenAI's API); ints are still accepted for float fields. forbid: a field
    # that is not declared is a 400 naming it.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str
    # Accepted and ignored: they label or route a request, they change nothing it returns.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes by itself
    safety_identifier: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    top_k: TopK = 0  # not in OpenAI's API; 0 switches it off (as vLLM and mlx-lm accept)
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Bias] | None = None
    # Not in OpenAI's API (vLLM and llama.cpp take it): end-of-sequence tokens do not end the
    # reply, so every request generates max_tokens, as a benchmark comparing servers needs.
    ignore_eos: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        for key in value:
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
        return value

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    def logprob_request(self) -> tuple[bool, int]:
        """``(logprobs wanted, top alternatives)``; each endpoint spells these its own way."""
        return False, 0

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Stop) -> Stop:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(len(s) > MAX_STOP_LENGTH for s in items):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_LENGTH} characters")
        return value

    def stop_list(self) -> tuple[str, ...]:
        items = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in items if s)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Body):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
MAX_TOOLS = 128


def parse_arguments(name: str, arguments: str) -> dict:
    """A past call's arguments (JSON text) as the object templates take.

    >>> parse_arguments("f", '{"x": 1}'), parse_arguments("f", "")
    ({'x': 1}, {})
    """
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        raise ValueError(f"arguments of {name!r} are not valid JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"arguments of {name!r} must be a JSON object")
    return value


class FunctionCall(_Body):
    name: FunctionName
    arguments: str  # JSON text

    def parsed_arguments(self) -> dict:
        return parse_arguments(self.name, self.arguments)


class ToolCall(_Body):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    reasoning_content: str | None = None  # a past turn's reasoning: not shown to the model again
    # What the official client echoes back from a response; only their empty values are taken.
    refusal: None = None
    annotations: Annotated[list[None], Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _check_roles(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        for call in self.tool_calls or ():
            call.function.parsed_arguments()
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates take it ("developer" is OpenAI's newer name for
        the system role; tool-call arguments as objects)."""
        out: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.parsed_arguments()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class FunctionDef(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # arguments always match the schema when the call is forced


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self

    def as_dict(self) -> dict:
        out: dict = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"name": self.json_schema.name,
                                  "schema": {} if self.json_schema.schema_ is None else self.json_schema.schema_}
        return out


# Names the chat template call takes itself: ``chat_template_kwargs`` may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "chat_template"})


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    # Reasoning: "none" asks a reasoning template not to think (``enable_thinking`` false);
    # any other effort lets it think. A model without reasoning answers as it always does.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Union[str, int, float, bool, None]] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.response_format is not None and self.response_format.type != "text" \
                and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("response_format and a forced tool_choice cannot both shape the output")
        return self

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self):
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs, (self.top_logprobs or 0) if self.logprobs else 0

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> "ChatCompletionRequest":
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ()))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")
        return self

    def template_kwargs(self) -> dict:
        """What the chat template gets besides the messages: ``chat_template_kwargs``, and
        ``enable_thinking`` from ``reasoning_effort`` unless those set it.

            >>> ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
            ...                       reasoning_effort="none").template_kwargs()
            {'enable_thinking': False}
        """
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out.setdefault("enable_thinking", self.reasoning_effort != "none")
        return out


class CompletionRequest(SamplingFields):
    prompt: Union[str, Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # legacy: the number of alternatives

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0
