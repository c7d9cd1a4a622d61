"""The Responses API's store (``server/http/responses/store.py``) without a server: bounded,
kept across a reopen, safe from several threads, and never the end of the server when its
file is not a database or is damaged. Plus the request's side of storing (``_turn``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading

import pytest

from kvserve.server.http.errors import APIError
from kvserve.server.http.responses.routes import _turn
from kvserve.server.http.responses.schemas import ResponsesRequest
from kvserve.server.http.responses.store import ASIDE, FILE_NAME, ResponseStore


def response(n: int, text: str = "") -> dict:
    return {"id": f"resp_{n}", "object": "response", "output": [{"id": f"msg_{n}", "text": text}]}


def items(n: int) -> list[dict]:
    return [{"id": f"in_{n}", "type": "message", "role": "user", "content": "é \u2603 " * n}]


def fill(store: ResponseStore, numbers) -> None:
    for n in numbers:
        assert store.put(response(n), items(n))


def test_the_store_keeps_the_newest_responses(tmp_path):
    store = ResponseStore.under(tmp_path, max_responses=3)
    fill(store, range(5))
    assert store.count() == 3
    assert [store.response_text(f"resp_{n}") is not None for n in range(5)] == [False, False, True, True, True]
    assert store.delete("resp_3") and store.count() == 2
    fill(store, [5, 6])  # a deleted row frees its place: the oldest left goes only past the bound
    assert [n for n in range(7) if store.input_items(f"resp_{n}") is not None] == [4, 5, 6]


def test_a_response_comes_back_as_stored_after_a_reopen(tmp_path):
    store = ResponseStore.under(tmp_path, max_responses=10)
    fill(store, range(3))
    store.close()
    assert (tmp_path / "responses" / FILE_NAME).is_file()
    reopened = ResponseStore.under(tmp_path, max_responses=10)
    assert reopened.response_text("resp_2") == '{"id":"resp_2","object":"response","output":[{"id":"msg_2","text":""}]}'
    assert reopened.input_items("resp_2") == items(2)
    assert reopened.conversation("resp_1") == items(1) + response(1)["output"]
    assert reopened.response_text("resp_9") is None and reopened.conversation("resp_9") is None
    # A smaller bound applies at the next write.
    smaller = ResponseStore.under(tmp_path, max_responses=1)
    fill(smaller, [3])
    assert smaller.count() == 1


def test_threads_share_one_store(tmp_path):
    store = ResponseStore.under(tmp_path, max_responses=1000)

    def writer(first: int) -> None:
        fill(store, range(first, first + 50))

    threads = [threading.Thread(target=writer, args=(k * 50,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.count() == 200 and all(store.input_items(f"resp_{n}") == items(n) for n in range(200))


def test_a_file_that_is_not_a_database_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "responses" / FILE_NAME
    path.parent.mkdir()
    path.write_bytes(b"not a database at all " * 100)
    with caplog.at_level(logging.ERROR, logger="kvserve.responses"):
        store = ResponseStore.under(tmp_path, max_responses=5)
    assert "moved aside" in caplog.text
    assert (tmp_path / "responses" / (FILE_NAME + ASIDE)).read_bytes() == b"not a database at all " * 100
    fill(store, [1])  # a new, empty file serves
    store.close()
    assert ResponseStore.under(tmp_path, max_responses=5).input_items("resp_1") == items(1)


def test_damaged_pages_found_while_serving_start_the_store_again(tmp_path, caplog):
    store = ResponseStore.under(tmp_path, max_responses=100)
    fill(store, range(40))
    store.close()
    path = tmp_path / "responses" / FILE_NAME
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[page:len(data)] = b"\xff" * (len(data) - page)  # every page but the first (the header, the schema)
    path.write_bytes(bytes(data))
    store = ResponseStore.under(tmp_path, max_responses=100)  # opens: the damage is past the header
    with caplog.at_level(logging.ERROR, logger="kvserve.responses"):
        assert store.response_text("resp_39") is None  # the read fails, the store starts again
    assert "malformed" in caplog.text and (tmp_path / "responses" / (FILE_NAME + ASIDE)).exists()
    fill(store, [40])
    assert store.count() == 1 and store.input_items("resp_40") == items(40)


def test_a_file_of_another_schema_version_is_moved_aside(tmp_path):
    path = tmp_path / "responses" / FILE_NAME
    path.parent.mkdir()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=99")
    store = ResponseStore.under(tmp_path, max_responses=5)
    fill(store, [1])
    assert store.count() == 1 and (tmp_path / "responses" / (FILE_NAME + ASIDE)).exists()


def test_a_folder_that_cannot_be_made_keeps_responses_in_memory(tmp_path, caplog):
    (tmp_path / "responses").write_text("a file where the folder would be")
    with caplog.at_level(logging.ERROR, logger="kvserve.responses"):
        store = ResponseStore.under(tmp_path, max_responses=5)
    assert "kept in memory" in caplog.text
    fill(store, [1])
    assert store.input_items("resp_1") == items(1)


def test_a_store_of_no_responses_keeps_none_and_refuses_store_true():
    store = ResponseStore(None, max_responses=0)
    assert not store.enabled and store.put(response(1), items(1)) is False and store.count() == 0
    turn = asyncio.run(_turn(ResponsesRequest(model="m", input="hi"), store))
    assert turn.stored is False  # OpenAI's default (store: true) quietly does not apply
    with pytest.raises(APIError) as caught:
        asyncio.run(_turn(ResponsesRequest(model="m", input="hi", store=True), store))
    assert (caught.value.status, caught.value.param) == (400, "store")


def test_a_turn_continues_the_stored_conversation():
    store = ResponseStore(None, max_responses=5)
    first = asyncio.run(_turn(ResponsesRequest(model="m", input="Hello"), store))
    assert first.stored and first.continued == 0 and [i["role"] for i in first.stored_items] == ["user"]
    answer = {"id": "msg_a", "type": "message", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]}
    store.put({"id": "resp_a", "output": [answer]}, first.stored_items)
    second = asyncio.run(_turn(ResponsesRequest(model="m", input="Bye", previous_response_id="resp_a",
                                                store=False), store))
    assert second.continued == 2 and not second.stored
    assert [i.text() for i in second.items] == ["Hello", "Hi!", "Bye"]
    assert second.stored_items[:2] == [*first.stored_items, answer]
    with pytest.raises(APIError) as caught:
        asyncio.run(_turn(ResponsesRequest(model="m", input="Bye", previous_response_id="resp_b"), store))
    assert (caught.value.status, caught.value.param, caught.value.code) == \
        (400, "previous_response_id", "previous_response_not_found")
