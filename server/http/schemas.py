"""OpenAI request and response bodies (the subset kvserve serves), validated by pydantic.

Fields that multiply work are capped here, before anything is tokenized. Unknown fields
are ignored, as OpenAI clients send many optional ones; known ones are typed strictly.

Example:
    >>> r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stop="x")
    >>> (r.stop_list(), r.stream, r.requested_max_tokens())
    (('x',), False, None)
"""

from __future__ import annotations

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
    # 400s, as in OpenAI's API); ints are still accepted for float fields.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str
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


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs, (self.top_logprobs or 0) if self.logprobs else 0

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class CompletionRequest(SamplingFields):
    prompt: Union[str, Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # legacy: the number of alternatives

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0
