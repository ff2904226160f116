"""Token caches kept out of the garbage collector's way, with bounded memory.

Token ids live in `array('I')` and `bytes` (4 bytes an id, one object; bytes and the tuples
holding them are not even tracked by the collector) instead of lists of ints (a full
collection walking 4,096 cached 2k-token lists took ~56 ms: the p99 at one connection).
Both caches are LRUs bounded in size, and a single huge prompt keeps at most a fixed share.

- `TokenCache`: whole requests by content -> `Tokens` (ids plus the picker's block-hash memo),
  so a repeated prompt is neither re-tokenized nor re-hashed.
- `PieceStore`: the prefix tree of prompt pieces (see `router.tokenize_split`): the key of a
  piece is (id of the piece before it, its text), so a hit means the whole text up to and
  including the piece is exactly one seen before, and its ids are exactly its tokens.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast


class Tokens(array):  # type: ignore[type-arg]
    """Token ids (array('I')) that remember their block hashes per (block size, namespace),
    so a prompt seen again (same system prompt, same document) is neither re-tokenized nor
    re-hashed (`router.core.picker` reads `hash_memo`)."""

    __slots__ = ("hash_memo",)
    hash_memo: dict[object, object]

    def __new__(cls, ids: Iterable[int] = ()) -> Tokens:
        self = cast(Tokens, super().__new__(cls, "I", ids))
        self.hash_memo = {}
        return self

    def __repr__(self) -> str:
        return f"Tokens({self.tolist()!r})"


class TokenCache:
    """An LRU of whole requests keyed by content, bounded in items and token ids; a request
    above `max_tokens // 16` ids is not kept (one huge prompt must not evict everything)."""

    def __init__(self, max_items: int = 4096, max_tokens: int = 8_000_000) -> None:
        self._items: OrderedDict[Hashable, Tokens] = OrderedDict()
        self.max_items = max_items
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Tokens | None:
        ids = self._items.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: Hashable, ids: Sequence[int]) -> Tokens:
        tokens = ids if isinstance(ids, Tokens) else Tokens(ids)
        if len(tokens) > self.max_tokens // 16:
            return tokens
        old = self._items.pop(key, None)
        self.tokens += len(tokens) - (len(old) if old is not None else 0)
        self._items[key] = tokens
        while self._items and (len(self._items) > self.max_items or self.tokens > self.max_tokens):
            self.tokens -= len(self._items.popitem(last=False)[1])
        return tokens

    def __len__(self) -> int:
        return len(self._items)


_NODE_OVERHEAD = 200  # bytes per piece beyond its text and ids: key tuple, value, dict slot


@dataclass
class Walk:
    """How far a prompt's pieces are known: ids of the first `found` pieces (array('I')
    bytes), and the node the next piece hangs from."""

    found: int = 0
    parent: int = 0
    known: list[bytes] = field(default_factory=list)


class PieceStore:
    """Ids of prompt pieces, keyed by (node id of everything before, piece text); bounded in
    bytes (LRU), and a prompt keeps at most `max_prompt_bytes` of pieces (its first ones:
    the shared part of real traffic is the beginning)."""

    def __init__(self, max_bytes: int = 64 << 20, max_prompt_bytes: int = 8 << 20) -> None:
        self._nodes: OrderedDict[tuple[int, str], tuple[int, bytes]] = OrderedDict()
        self._next_id = itertools.count(1)  # never reused: a stale parent id matches nothing
        self.max_bytes = max_bytes
        self.max_prompt_bytes = max_prompt_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def walk(self, pieces: Sequence[str]) -> Walk:
        w = Walk()
        nodes = self._nodes
        for piece in pieces:
            node = nodes.get((w.parent, piece))
            if node is None:
                break
            nodes.move_to_end((w.parent, piece))
            w.parent = node[0]
            w.known.append(node[1])
            w.found += 1
        self.hits += w.found
        self.misses += len(pieces) - w.found
        return w

    def add(self, parent: int, pieces: Sequence[str], ids: Sequence[bytes]) -> None:
        """Remember `pieces` (following node `parent`) and their ids (array('I') bytes), as
        far as the per-prompt share allows."""
        spent = 0
        for piece, raw in zip(pieces, ids, strict=True):
            size = _size(piece, raw)
            spent += size
            if spent > self.max_prompt_bytes:
                break
            key = (parent, piece)
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = (next(self._next_id), raw)
                self.bytes += size
            parent = node[0]
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._nodes:
            (_, piece), (_, raw) = self._nodes.popitem(last=False)
            self.bytes -= _size(piece, raw)

    def __len__(self) -> int:
        return len(self._nodes)


def _size(piece: str, raw: bytes) -> int:
    return sys.getsizeof(piece) + len(raw) + _NODE_OVERHEAD
