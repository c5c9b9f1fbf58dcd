"""The Responses API's store: finished responses kept in memory for `GET /v1/responses/{id}` and
for `previous_response_id`, bounded by count and by bytes, least recently used first out.

Each entry holds the response object as it was answered and the conversation it ended (every
message before it, its input and its reply, instructions left out as OpenAI leaves them out), so a
follow-up needs only this one entry: evicting an older turn never breaks a later one's chain.
Its output items can also be named alone (`item_reference` input items, as the AI SDK sends a
past reply).
Entries belong to the caller that made them (its API key's hash, nanoserve/server/streaming/clients.py):
another key asking for the id is told it does not exist. Nothing survives a restart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_json

Message = Mapping[str, Any]  # {"role": ..., "content": ...}, as the chat template reads it


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as answered
    conversation: tuple[Message, ...]  # the messages a follow-up continues, its reply last
    size: int  # bytes counted against the bound


class ResponseStore:
    """An LRU map of (owner, response id) -> StoredResponse, at most `max_entries` entries and
    `max_bytes` of their JSON; one larger than `max_bytes` alone is not kept. `max_entries` 0 keeps
    nothing. Thread-safe (a lock; it is also only touched from the event loop today)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._items: dict[tuple[str, str], str] = {}  # (owner, output item id) -> its response's id
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, owner: str, response: dict[str, Any], conversation: Sequence[Message]) -> bool:
        """Keep a finished response (evicting the least recently used as needed); False when it
        cannot be kept (storing is off, or it alone is over the byte bound)."""
        size = len(to_json(response)) + len(to_json(list(conversation)))
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        entry = StoredResponse(response, tuple(conversation), size)
        with self._lock:
            self._pop((owner, response["id"]))
            self._entries[(owner, response["id"])] = entry
            self._bytes += size
            for item in response["output"]:
                self._items[(owner, item["id"])] = response["id"]
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._pop(next(iter(self._entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The owner's response by id (now the most recently used), else None."""
        with self._lock:
            entry = self._entries.get((owner, response_id))
            if entry is not None:
                self._entries.move_to_end((owner, response_id))
            return entry

    def item(self, owner: str, item_id: str) -> dict[str, Any] | None:
        """An output item of one of the owner's stored responses, by its id (what OpenAI's
        `item_reference` input names), else None."""
        response_id = self._items.get((owner, item_id))
        entry = self.get(owner, response_id) if response_id is not None else None
        if entry is None:
            return None
        return next((i for i in entry.response["output"] if i["id"] == item_id), None)

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            return self._pop((owner, response_id)) is not None

    def _pop(self, key: tuple[str, str]) -> StoredResponse | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
            for item in entry.response["output"]:
                self._items.pop((key[0], item["id"]), None)
        return entry
