"""The items of a Responses ``input``: messages, function calls, their outputs and past
reasoning. Each item is validated on its own, so a 400 names the item and the field at fault
(``input.2.content.0``) instead of every branch of a union.

The official client sends a response's ``output`` back as the next ``input``; those items
carry ids, statuses and empty annotations, which are accepted. A past ``reasoning`` item is
accepted and not shown to the model again (as chat's ``reasoning_content``). A stored
response keeps its input items as ``stored_item`` spells them: as OpenAI lists them back, and
as ``parse_input`` takes them again when a later request continues the conversation.

Example:
    >>> items = parse_input([{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    ...                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    >>> [type(i).__name__ for i in items], items[0].text()
    (['MessageItem', 'FunctionCallItem'], 'hi')
    >>> item = stored_item(parse_input("Hello")[0])
    >>> item["content"], item["id"], item["status"]
    ([{'type': 'input_text', 'text': 'Hello'}], 'msg_...', 'completed')
    >>> parse_input([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    Traceback (most recent call last):
    ...
    kvserve.server.http.errors.APIError: Value error, content parts of type 'input_image' are not served: ...
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationError, model_validator

from kvserve.server.http.errors import APIError
from kvserve.server.http.responses.items import new_id
from kvserve.server.http.responses.schemas import StrictBody
from kvserve.server.http.schemas import FunctionName, parse_arguments

TEXT_PARTS = ("input_text", "output_text")
Status = Literal["in_progress", "completed", "incomplete"]
ItemId = Annotated[str, Field(max_length=256)]


class ContentPart(StrictBody):
    type: Literal["input_text", "output_text"]
    text: str
    # Echoed back from an output message: only their empty values are taken.
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in TEXT_PARTS:
            raise ValueError(f"content parts of type {kind!r} are not served: kvserve takes text "
                             f"({', '.join(TEXT_PARTS)})")
        return data


Content = Union[str, list[ContentPart]]


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: ItemId | None = None
    status: Status | None = None

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: str  # JSON text
    id: ItemId | None = None
    status: Status | None = None

    @model_validator(mode="after")
    def _arguments_are_an_object(self) -> "FunctionCallItem":
        self.parsed_arguments()
        return self

    def parsed_arguments(self) -> dict:
        return parse_arguments(self.name, self.arguments)


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: ItemId
    output: Content
    id: ItemId | None = None
    status: Status | None = None

    def text(self) -> str:
        return _text(self.output)


class ReasoningItem(StrictBody):
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
ITEM_MODELS: dict[str, type[StrictBody]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                       "function_call_output": FunctionCallOutputItem,
                                       "reasoning": ReasoningItem}
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def parse_input(value: str | list[dict]) -> list[Item]:
    """The items of ``input`` (a string is one user message); a 400 names the bad item."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    return [_item(i, raw) for i, raw in enumerate(value)]


def _item(index: int, raw: dict) -> Item:
    kind = raw.get("type", "message")  # a message may leave its type out
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        why = "items are not looked up by id: send the item itself" if kind == "item_reference" \
            else f"kvserve takes {', '.join(ITEM_MODELS)} items"
        raise APIError(400, f"input items of type {kind!r} are not served: {why}", param=f"input.{index}.type",
                       code="invalid_value")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, where = _first_error(exc)
        param = f"input.{index}{where}"
        raise APIError(400, f"{message} ({param})", param=param, code="invalid_value") from None


def _first_error(exc: ValidationError) -> tuple[str, str]:
    """The most specific error (a union fails once per branch; the deepest one says why) and
    its path, without pydantic's branch names.

    >>> try:
    ...     MessageItem.model_validate({"role": "user", "content": [{"type": "input_text"}]})
    ... except ValidationError as exc:
    ...     _first_error(exc)
    ('Field required', '.content.0.text')
    """
    error = max(exc.errors(), key=lambda e: len(e["loc"]))
    loc = [str(p) for p in error["loc"] if not (isinstance(p, str) and (p == "str" or "[" in p))]
    return error["msg"], "".join(f".{p}" for p in loc)


def stored_item(item: Item) -> dict:
    """``item`` as a stored response keeps it, and as ``GET /v1/responses/{id}/input_items``
    lists it: with an id and a status where the client gave none, and a message's text as
    one content part (the same text, so the same prompt when a later turn renders it)."""
    data = item.model_dump(exclude_none=True, by_alias=True)
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part = {"type": "output_text", "text": item.content, "annotations": []} if item.role == "assistant" \
            else {"type": "input_text", "text": item.content}
        data["content"] = [part]
    data.setdefault("id", new_id(ID_PREFIXES[data["type"]]))
    if not isinstance(item, ReasoningItem):  # OpenAI's reasoning items carry no status
        data.setdefault("status", "completed")
    return data
