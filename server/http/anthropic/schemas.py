"""Anthropic Messages API request bodies (the subset kvserve serves), validated by pydantic.

As for OpenAI's bodies, a field kvserve cannot honour is a 400 naming it; ``cache_control``
hints are accepted anywhere Anthropic allows them and change nothing (the prefix cache finds
shared prefixes by itself).

Example:
    >>> body = MessagesRequest(model="m", max_tokens=8, messages=[
    ...     {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    >>> body.messages[0].content[0].text, body.tool_choice
    ('hi', None)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.server.http.schemas import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, MAX_TOOLS, MaxTokens, TopK


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class CacheHint(_Body):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheHint | None = None
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(max_length=256)]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    input: dict
    cache_control: CacheHint | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(max_length=256)]
    content: Union[str, list[TextBlock], None] = None
    is_error: bool | None = None
    cache_control: CacheHint | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(_Body):
    """A past turn's reasoning, sent back by agents: not shown to the model again."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """Name a block kvserve cannot take (an image, a document) instead of failing on
        the shape of every alternative."""
        blocks = data.get("content") if isinstance(data, dict) else None
        for block in blocks if isinstance(blocks, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(f"content blocks of type {kind!r} are not supported "
                                 f"(only {', '.join(BLOCK_TYPES)})")
        return data

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "Message":
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        if self.role == "user" and kinds & {"tool_use", "thinking"}:
            raise ValueError("tool_use and thinking blocks belong to assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong to user messages")
        return self


class Tool(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheHint | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type tool needs a name, and only it")
        return self


class Metadata(_Body):
    user_id: str | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Body):
    """Structured output: the reply is a JSON document matching ``format.schema``."""

    format: OutputFormat | None = None


class ThinkingConfig(_Body):
    """Extended thinking: ``enabled`` (with a budget below ``max_tokens``, as Anthropic's API
    requires; its floor of 1,024 tokens is not kept: a small local model thinks usefully in
    fewer, and llama.cpp's server takes any budget) or ``adaptive`` lets a reasoning template
    think (``enable_thinking``), ``disabled`` asks it not to. A model without reasoning
    answers as it always does. A reasoning model thinks for at most ``budget_tokens``
    tokens: then its thinking block is closed for it (``engine/thinking.py``) and it
    answers; ``max_tokens`` bounds thinking and answer together."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _budget(self) -> "ThinkingConfig":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.budget_tokens is required when thinking is enabled")
        return self

    @property
    def template_kwargs(self) -> dict:
        return {"enable_thinking": self.type != "disabled"}


class MessagesRequest(_Body):
    model: str
    max_tokens: MaxTokens
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Annotated[list[Annotated[str, Field(max_length=MAX_STOP_LENGTH)]],
                              Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    # Sampling: current clients no longer send these (the API's default is temperature 1);
    # earlier ones, and extra_body, still may.
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: TopK | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: ThinkingConfig | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheHint | None = None
    speed: Literal["standard"] | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> "MessagesRequest":
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        forced = choice is not None and choice.type in ("any", "tool")
        if forced and self.output_config is not None and self.output_config.format is not None:
            raise ValueError("output_config.format and a forced tool_choice cannot both shape the output")
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({self.max_tokens})")
        return self

    def thinking_budget(self) -> int | None:
        """The thinking tokens allowed (None: no budget)."""
        enabled = self.thinking is not None and self.thinking.type == "enabled"
        return self.thinking.budget_tokens if enabled else None

    def system_text(self) -> str:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system or ""


class CountTokensRequest(_Body):
    """``/v1/messages/count_tokens``: the prompt fields of a message request."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheHint | None = None

    def system_text(self) -> str:
        return MessagesRequest.system_text(self)  # type: ignore[arg-type]
