"""OpenAI request and response bodies (the subset kvserve serves), validated by pydantic.

Fields that multiply work are capped here, before anything is tokenized. Unknown fields
are ignored, as OpenAI clients send many optional ones.

Example:
    >>> r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stop="x")
    >>> (r.stop_list(), r.stream, r.requested_max_tokens())
    (('x',), False, None)
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
Stop = Union[str, list[str], None]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    n: Annotated[int, Field(ge=1, le=1)] = 1  # several choices arrive with batching

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
