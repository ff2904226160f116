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

Both keep only what was seen twice (`SeenKeys` remembers the first sighting as one 8-byte
key). Traffic of distinct prompts would otherwise churn the caches at its full rate for
nothing: measured on the packaged tokenizer, a 64 MB store full of pieces no prompt ever
shared made the tokenizer itself ~40% slower per prompt (0.75 -> 1.05-1.5 ms for 2k tokens),
on top of the bookkeeping. A text seen once is encoded as one string (no per-piece cost); the
second time its pieces are encoded alone and kept; from the third on they are reused.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast


class HashMemo(dict[object, object]):
    """The picker's block-hash memo on `Tokens`: each list of hashes it stores is kept as a
    tuple, which holds only ints, so the collector stops walking it (4,096 cached prompts'
    lists made a full collection ~10x slower: `python -m router.bench.tokenize`).

    An LRU of at most `MAX_ENTRIES` (block size, namespace) keys: a distinct `cache_salt`
    per user on one hot prefix is a new namespace each, and unbounded they held one hash
    tuple each (20,000 salts on a 4.5k-token prefix: 254 MB). The namespaces most requests
    share (no salt, a few models and LoRAs) are read on every pick, so they stay."""

    MAX_ENTRIES = 64

    def get(self, key: object, default: object = None) -> object:
        value = super().pop(key, _MISSING)
        if value is _MISSING:
            return default
        super().__setitem__(_KEYS.get(key, key), value)  # now the most recent
        return value

    def __setitem__(self, key: object, value: object) -> None:
        key = _KEYS.setdefault(key, key) if len(_KEYS) < 1024 else key  # one key object
        super().pop(key, None)
        super().__setitem__(key, tuple(value) if isinstance(value, list) else value)
        if len(self) > self.MAX_ENTRIES:
            del self[next(iter(self))]


_KEYS: dict[object, object] = {}  # (block size, namespace) keys, shared by every memo
_MISSING = object()


class Tokens(array):  # type: ignore[type-arg]
    """Token ids (array('I')) that remember their block hashes per (block size, namespace),
    so a prompt seen again (same system prompt, same document) is neither re-tokenized nor
    re-hashed (`router.core.picker` reads `hash_memo`).

    `shared_prefix`, when set, is (n, memo): the first n ids are exactly those of a text
    prefix other prompts share (a known document, a system prompt, the conversation so
    far), and `memo` is that prefix's own hash memo, so a new tail after it hashes only its
    own blocks."""

    __slots__ = ("hash_memo", "shared_prefix")
    hash_memo: HashMemo
    shared_prefix: tuple[int, HashMemo] | None

    def __new__(cls, ids: Iterable[int] = ()) -> Tokens:
        self = cast(Tokens, super().__new__(cls, "I", ids))
        self.hash_memo = HashMemo()
        self.shared_prefix = None
        return self

    def __repr__(self) -> str:
        return f"Tokens({self.tolist()!r})"


_U64 = (1 << 64) - 1


class SeenKeys:
    """Keys seen lately, in a fixed table of 64-bit slots. A key may sit in either of two
    slots (named by its low and its high bits) and takes a free one, else pushes out the
    first slot's key: one `array`, so a flood of new keys costs no memory growth and no
    garbage-collector work, and a key survives about `slots` newer keys. Only admission
    depends on it, never a result: a key pushed out early means a text is kept one
    sighting later (with one slot per key, 1-2% of 2k-token prompts lost a key to another
    of their own), a colliding key (2**-64) one sighting sooner."""

    def __init__(self, slots: int = 1 << 18) -> None:
        if slots & (slots - 1):
            raise ValueError("slots must be a power of two")
        self._mask = slots - 1
        self._table = array("Q", bytes(8 * slots))

    def seen(self, key: int) -> bool:
        key = key & _U64 or 1  # 0 marks an empty slot
        t, m = self._table, self._mask
        return t[key & m] == key or t[(key >> 40) & m] == key

    def add(self, key: int) -> None:
        key = key & _U64 or 1
        t, m = self._table, self._mask
        i, j = key & m, (key >> 40) & m
        if t[i] == key or t[j] == key:
            return
        t[j if t[i] and not t[j] else i] = key

    def first_sighting(self, key: int) -> bool:
        """True (and remembered) the first time `key` comes; False once seen."""
        if self.seen(key):
            return False
        self.add(key)
        return True


class TokenCache:
    """An LRU of whole requests keyed by content, bounded in items and token ids, keeping a
    request from its second sighting on; a request above `max_tokens // 16` ids is not kept
    (one huge prompt must not evict everything)."""

    def __init__(self, max_items: int = 4096, max_tokens: int = 8_000_000) -> None:
        self._items: OrderedDict[Hashable, Tokens] = OrderedDict()
        self._seen = SeenKeys(1 << 16)
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
        if len(tokens) > self.max_tokens // 16 or self._seen.first_sighting(hash(key)):
            return tokens
        old = self._items.pop(key, None)
        self.tokens += len(tokens) - (len(old) if old is not None else 0)
        self._items[key] = tokens
        while self._items and (len(self._items) > self.max_items or self.tokens > self.max_tokens):
            self.tokens -= len(self._items.popitem(last=False)[1])
        return tokens

    def __len__(self) -> int:
        return len(self._items)


class PrefixMemos:
    """Hash memos of known text prefixes, by (piece node id, whether the prompt has the
    tokenizer's specials), for `Tokens.shared_prefix`: a node id names one exact text, and
    its ids are exactly that text's tokens, so every prompt walking through the node starts
    with the same ids and so the same block hashes. An LRU bounded in items and in the
    prefix tokens they cover (the picker fills a memo with about one hash per block)."""

    def __init__(self, max_items: int = 4096, max_tokens: int = 4_000_000) -> None:
        self._items: OrderedDict[tuple[int, bool], tuple[int, HashMemo]] = OrderedDict()
        self.max_items = max_items
        self.max_tokens = max_tokens
        self.tokens = 0

    def get(self, node: int, specials: bool, n_tokens: int) -> tuple[int, HashMemo]:
        """The shared prefix of `n_tokens` ids ending at `node` (made on first use)."""
        key = (node, specials)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            return found
        found = self._items[key] = (n_tokens, HashMemo())
        self.tokens += n_tokens
        while len(self._items) > self.max_items or self.tokens > self.max_tokens:
            self.tokens -= self._items.popitem(last=False)[1][0]
        return found


_NODE_OVERHEAD = 200  # bytes per piece beyond its text and ids: key tuple, value, dict slot


@dataclass
class Walk:
    """How far a prompt is known: ids of the pieces found (array('I') bytes), the node the
    next piece hangs from, the pieces still to encode, and the coarse piece that was walked
    in fine pieces (its parent node, its text, its fine pieces known and left). Of `rest`,
    the first `admit` pieces were seen once before (they are encoded alone and kept); `keys`
    names each piece of `rest` with everything before it, for the next sighting."""

    parent: int = 0
    known: list[bytes] = field(default_factory=list)
    rest: list[str] = field(default_factory=list)
    split: tuple[int, str, int, int] | None = None
    admit: int = 0
    keys: list[int] = field(default_factory=list)
    # the last cut between two coarse pieces the walk got past: characters walked (from
    # where it started), the node there and how many of `known` lead to it
    anchor: tuple[int, int, int] | None = None


@dataclass
class Anchor:
    """A text prefix ending just before a cut between coarse pieces (`text` holds the cut's
    own character too), the piece node there and the ids of the pieces up to it. A prompt
    that starts with `text` is cut exactly as that prefix was up to there (a cut depends
    only on the text before it and the character at it), so its walk may start here."""

    text: str
    parent: int
    known: list[bytes]


class Anchors:
    """Recent anchors, by their first `key_chars` characters (several documents may follow
    one system prompt): a prompt over a long known prefix skips cutting and looking up its
    coarse pieces one by one. Bounded in characters (LRU)."""

    PER_KEY = 16  # conversations or documents after one opening, newest first

    def __init__(self, key_chars: int, max_chars: int = 4 << 20) -> None:
        self.key_chars = key_chars
        self.max_chars = max_chars
        self.chars = 0
        self._by_key: OrderedDict[str, list[Anchor]] = OrderedDict()

    def find(self, text: str) -> Anchor | None:
        """The longest anchor `text` starts with."""
        found = self._by_key.get(text[: self.key_chars])
        if found is None:
            return None
        best = None
        for a in found:
            if (best is None or len(a.text) > len(best.text)) and text.startswith(a.text):
                best = a
        return best

    def note(self, text: str, walk: Walk, offset: int) -> None:
        """Keep where `walk` (over `text` from character `offset`, its anchor's cut) got
        past its last coarse cut."""
        if walk.anchor is None:
            return
        walked, parent, n = walk.anchor
        end = offset + walked
        if end < self.key_chars:
            return
        key = text[: self.key_chars]
        found = self._by_key.get(key)
        if found is None:
            found = self._by_key[key] = []
        else:
            self._by_key.move_to_end(key)
        if any(len(a.text) == end + 1 and text.startswith(a.text) for a in found):
            return  # known already
        found.insert(0, Anchor(text[: end + 1], parent, walk.known[:n]))
        self.chars += end + 1
        for old in found[self.PER_KEY :]:
            self.chars -= len(old.text)
        del found[self.PER_KEY :]
        self._evict(found[0])

    def _evict(self, keep: Anchor) -> None:
        """Over budget: the oldest anchors of the least recent opening go first, never
        `keep` (the one just made)."""
        while self.chars > self.max_chars:
            key, oldest = next(iter(self._by_key.items()))
            if oldest[-1] is keep:
                return
            self.chars -= len(oldest.pop().text)
            if not oldest:
                del self._by_key[key]


class PieceStore:
    """Ids of prompt pieces, keyed by (node id of everything before, piece text); bounded in
    bytes (LRU), and a prompt keeps at most `max_prompt_bytes` of pieces (its first ones:
    the shared part of real traffic is the beginning).

    A node id stands for one exact text (everything up to and including its piece), however
    it was cut, so coarse and fine pieces share the tree: coarse pieces make the walk over a
    long known prefix cheap; the coarse piece where a prompt leaves the known text is walked
    again in fine pieces, so only the text after the last shared fine piece is new; and once
    its fine pieces are all known, the coarse piece is added as one node ending at the same
    id, so the next walk over it is one step again.

    A piece is added on its second sighting: the first is remembered in `SeenKeys` by a
    64-bit key chained over everything before it (Python's hash of (previous key, text)).
    """

    def __init__(
        self, max_bytes: int = 64 << 20, max_prompt_bytes: int = 8 << 20, seen_slots: int = 1 << 18
    ) -> None:
        self._nodes: OrderedDict[tuple[int, str], tuple[int, bytes]] = OrderedDict()
        self._seen = SeenKeys(seen_slots)
        self._next_id = itertools.count(1)  # never reused: a stale parent id matches nothing
        self.max_bytes = max_bytes
        self.max_prompt_bytes = max_prompt_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def walk(
        self,
        pieces: Sequence[str],
        refine: Callable[[str], list[str]],
        anchor: Anchor | None = None,
    ) -> Walk:
        """Follow `pieces` (coarse) from the root, or from `anchor` (the pieces are then
        what follows its text); at the first unknown one, follow its `refine`d (fine)
        pieces; what is left is `rest`."""
        w = Walk()
        nodes, known, parent = self._nodes, w.known, 0
        if anchor is not None:
            parent = anchor.parent
            known.extend(anchor.known)
        walked = 0
        for i, piece in enumerate(pieces):
            if i:
                w.anchor = (walked, parent, len(known))
            walked += len(piece)
            node = nodes.get((parent, piece))
            if node is not None:
                nodes.move_to_end((parent, piece))
                parent = node[0]
                known.append(node[1])
                continue
            start, fine, k = parent, refine(piece), 0
            for sub in fine:
                node = nodes.get((parent, sub))
                if node is None:
                    break
                nodes.move_to_end((parent, sub))
                parent = node[0]
                known.append(node[1])
                k += 1
            if k < len(fine):
                w.rest = [*fine[k:], *pieces[i + 1 :]]
                w.split = (start, piece, k, len(fine) - k)
                break
            self._put((start, piece), parent, b"".join(known[-k:]))
        w.parent = parent
        self.hits += len(known)
        self.misses += len(w.rest)
        self._sighted(w)
        return w

    def _sighted(self, w: Walk) -> None:
        """Key each piece left to encode; count the leading ones seen before."""
        key, keys, seen = w.parent, w.keys, self._seen.seen
        for piece in w.rest:
            key = hash((key, piece))
            keys.append(key)
        admit = 0
        for key in keys:
            if not seen(key):
                break
            admit += 1
        w.admit = admit

    def add(self, w: Walk, ids: Sequence[bytes]) -> None:
        """Keep the admitted pieces of `w.rest` (after node `w.parent`) with their ids
        (array('I') bytes, one per admitted piece), as far as the per-prompt share allows,
        and the coarse piece that was split; remember the others as seen once."""
        add = self._seen.add
        for key in w.keys[w.admit :]:
            add(key)
        parent, spent, ends = w.parent, 0, []
        for piece, raw in zip(w.rest[: w.admit], ids, strict=True):
            spent += _size(piece, raw)
            if spent > self.max_prompt_bytes:
                break
            parent = self._put((parent, piece), next(self._next_id), raw)
            ends.append(parent)
        if w.split is not None and len(ends) >= w.split[3]:
            start, piece, k, new = w.split
            raw = b"".join([*w.known[len(w.known) - k :], *ids[:new]])
            if spent + _size(piece, raw) <= self.max_prompt_bytes:
                self._put((start, piece), ends[new - 1], raw)
        self._evict()

    def _put(self, key: tuple[int, str], node_id: int, raw: bytes) -> int:
        """The id of the node at `key`, added (as `node_id`, `raw`) if it is new."""
        node = self._nodes.get(key)
        if node is None:
            self._nodes[key] = (node_id, raw)
            self.bytes += _size(key[1], raw)
            return node_id
        return node[0]

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._nodes:
            (_, piece), (_, raw) = self._nodes.popitem(last=False)
            self.bytes -= _size(piece, raw)

    def __len__(self) -> int:
        return len(self._nodes)


def _size(piece: str, raw: bytes) -> int:
    return sys.getsizeof(piece) + len(raw) + _NODE_OVERHEAD
