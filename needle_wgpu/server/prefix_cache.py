"""Prefix caching across requests (llama.cpp's ``cache_prompt``): a model's worker keeps the
conversations of recent chat requests open, with the KV cache each holds, and answers a new
request on the one whose cached ids share the longest prefix with the request's rendering. Only
the rest is prefilled (``Conversation``'s own prefix rule: it rewinds, or opens a new session
where a cache cannot rewind); the ids are those of a fresh conversation. Bounded by bytes (each
entry holds one session's KV cache), least recently used first out. Used by the requests'
threads of one model (``batching``), under its lock."""

from __future__ import annotations

import threading

from ..chat.template import check_messages
from ..chat.tools import check_tools
from ..errors import NeedleError


class PrefixCache:
    """Open conversations by (context, kv), most recently used last; at most
    ``max_bytes // entry_bytes`` of them (``entry_bytes``: one sequence's KV cache, set once the
    model is loaded; 0 keeps none)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.entry_bytes = 0
        self.entries: list = []  # (key, conversation), least recently used first
        self.lock = threading.RLock()

    @property
    def capacity(self) -> int:
        return self.max_bytes // self.entry_bytes if self.entry_bytes > 0 else 0

    def take(self, model, messages, tools, *, context=None, kv=None):
        """The kept conversation whose cached ids share the longest prefix with ``messages``
        rendered (removed from the cache while it runs), or a new one; None when the cache
        keeps nothing (the request then runs on its own conversation, closed after it)."""
        if self.capacity == 0:
            return None
        with self.lock:
            taken = self._take(model, messages, tools, (context, kv))
        return taken if taken is not None else model.conversation(context=context, kv=kv)

    def _take(self, model, messages, tools, key):
        candidates = [(i, c) for i, (k, c) in enumerate(self.entries) if k == key]
        best = None
        if candidates:
            try:
                ids = model.chat_format.render_ids(model.tokenizer, check_messages(messages), check_tools(tools))
            except NeedleError:
                ids = []  # chat_completion reports the problem; any conversation does meanwhile
            best = max(candidates, key=lambda item: _shared(item[1].cached, ids))
            del self.entries[best[0]]
            return best[1]
        return None

    def give(self, conversation, *, context=None, kv=None) -> None:
        """Keep ``conversation`` (most recently used); the least recently used ones past the
        bound are closed, their KV caches freed."""
        if conversation is None:
            return
        with self.lock:
            self.entries.append(((context, kv), conversation))
            old = [self.entries.pop(0)[1] for _ in range(max(0, len(self.entries) - self.capacity))]
        for conversation in old:
            conversation.close()

    def evict_oldest(self) -> bool:
        """Close the least recently used entry (its session goes back to the KV pool)."""
        with self.lock:
            old = self.entries.pop(0)[1] if self.entries else None
        if old is not None:
            old.close()
        return old is not None

    def clear(self) -> None:
        with self.lock:
            entries, self.entries = self.entries, []
        for _, conversation in entries:
            conversation.close()

    def cached_bytes(self) -> int:
        return len(self.entries) * self.entry_bytes


def _shared(held: list, ids: list) -> int:
    same = 0
    for a, b in zip(held, ids):
        if a != b:
            break
        same += 1
    return same
