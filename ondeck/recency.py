"""A map that forgets its least recently used entries first, past a count or a size,
and counts how often it was asked and had the answer: the prompt caches' store."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class LeastRecentlyUsed:
    """Entries by key, at most ``max_entries`` of them and ``max_bytes`` of what their
    ``put`` said they take (None: no limit); the least recently used go first. ``hits``
    and ``misses`` count the ``get`` calls that found an entry and those that did not."""

    def __init__(self, max_entries: int, max_bytes: int | None = None):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, value: Any, nbytes: int = 0) -> None:
        with self._lock:
            if key in self._entries:
                self._nbytes -= self._entries.pop(key)[1]
            self._entries[key] = (value, nbytes)
            self._nbytes += nbytes
            while self._entries and (
                len(self._entries) > self.max_entries
                or (self.max_bytes is not None and self._nbytes > self.max_bytes)
            ):
                self._nbytes -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    def values(self) -> list[Any]:
        """The entries' values, least recently used first."""
        with self._lock:
            return [value for value, _ in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries
