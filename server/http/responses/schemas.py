"""OpenAI Responses API request bodies (the subset kvserve serves), validated by pydantic.

As for chat completions, a field kvserve cannot honour is a 400 that names it, never
silently dropped; the labels that change nothing (``user``, ``metadata``,
``truncation: "disabled"``...) are accepted. ``store`` and ``previous_response_id`` are
served (``routes.py``, ``store.py``). ``input`` items are validated one by one in
``convert.py``, so an error names the item (``input.2.content.0``) rather than every branch
of a union.

Example:
    >>> body = ResponsesRequest(model="m", input="hi", tools=[{"type": "function", "name": "f"}],
    ...                         tool_choice={"type": "function", "name": "f"})
    >>> body.tool_choice_value(), body.response_format() is None
    ({'type': 'function', 'function': {'name': 'f'}}, True)
    >>> ResponsesRequest(model="m", input="hi", background=True)
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for ResponsesRequest
    background
      Value error, background responses are not served: a response is answered to its request ...
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvserve.server.http.schemas import MAX_TOOLS, FunctionName, MaxTokens, Temperature, TopP


class StrictBody(BaseModel):
    # As in ../schemas.py: strict types, and an undeclared field is a 400 naming it.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # arguments always match the schema when the call is forced

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tools of type {kind!r} are not served: kvserve runs no built-in tools, "
                             "only function tools")
        return data

    def chat_dict(self) -> dict:
        """The tool in chat completions' shape, spelled as that route spells it (unset fields
        left out), so both routes render the same prompt."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(StrictBody):
    type: Literal["function"]
    name: FunctionName


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a text format of type json_schema needs a name and a schema")
        if self.type != "json_schema" and (self.name, self.schema_) != (None, None):
            raise ValueError(f"a text format of type {self.type} takes no name or schema")
        return self


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("verbosity cannot be set: the model answers at the length it answers")
        return value


class ReasoningConfig(StrictBody):
    effort: Any = None
    summary: Any = None
    generate_summary: Any = None

    @field_validator("effort", "summary", "generate_summary")
    @classmethod
    def _unset(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"reasoning {info.field_name} cannot be set: the model reasons (or not) "
                             "as its chat template says")
        return value


class StreamOptions(StrictBody):
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_padding(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("stream events are not padded: include_obfuscation must be false or absent")
        return value


# Fields of OpenAI's API that kvserve serves only in their neutral value: (accepted, why not).
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "conversation": ((None,), "conversation objects are not served: continue from a response with "
                              "previous_response_id, or send the whole conversation in input"),
    "background": ((None, False), "background responses are not served: a response is answered to its "
                                  "request (streamed or whole)"),
    "include": ((None, []), "there is no extra output to include"),
    "truncation": ((None, "disabled"), "input is never truncated: a prompt over the context is a 400"),
}

# OpenAI fields that are refused when set but taken as absent when null: SDKs that spell
# every parameter send these as null.
NULL_IS_ABSENT = frozenset({"max_tool_calls", "top_logprobs", "prompt", "prompt_cache_retention",
                            "context_management", "background_options", "moderation", "image",
                            "access_programs", "prompt_cache_options"})


class ResponsesRequest(StrictBody):
    model: str
    input: Union[str, Annotated[list[dict], Field(min_length=1)]]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # Accepted and ignored: they label or route a request, they change nothing it returns.
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes by itself
    service_tier: str | None = None
    # Kept (unless false: OpenAI's default is true), and continued from (routes.py).
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Served in their neutral value only (UNSERVED).
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_ABSENT):
            return {k: v for k, v in data.items() if not (k in NULL_IS_ABSENT and v is None)}
        return data

    @field_validator(*UNSERVED)
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, why = UNSERVED[info.field_name]
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise ValueError(why)
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tool_choice of type {kind!r} is not served: use auto, none, required "
                             "or a function")
        return value

    @model_validator(mode="after")
    def _check_tools(self) -> "ResponsesRequest":
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if self.forced and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        if self.forced and self.response_format() is not None:
            raise ValueError("text.format and a forced tool_choice cannot both shape the output")
        return self

    @property
    def forced(self) -> bool:
        return self.tool_choice not in (None, "none", "auto")

    @property
    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def tool_choice_value(self) -> Any:
        """The choice as chat completions spell it (``ChatInput.tool_choice``)."""
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return {"type": "function", "function": {"name": choice.name}}
        return choice or "auto"

    def response_format(self) -> dict | None:
        """``text.format`` as chat completions' ``response_format`` (None: free text)."""
        fmt = self.text_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
