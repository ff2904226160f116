"""Prefix reuse in tokenization is exact: the cut rule of `router.tokenize_split` holds on
random texts (every cut of every text) for the packaged tokenizer and for a byte-level BPE
trained here on whitespace-heavy text (the packaged vocabulary has no whitespace merges, so
alone it could not catch a cut inside a whitespace run), and `LocalTokenizer`'s pieced,
cached, threaded path gives the tokenizer's own ids for prompts that share prefixes, in any
order, sync and async."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_texts import any_texts, texts, train_tokenizer
from tokenizers import Tokenizer

from indexer.hashing import Namespace, hash_request
from router import tokenize_threads
from router.core import picker as picker_module
from router.core.picker import _hashes
from router.textgen import filler
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer
from router.tokenize_split import Splittable, cut_points, pieces, splittable
from router.tokenize_store import PieceStore, PrefixMemos, SeenKeys, TokenCache, Tokens, Walk
from router.tokenize_threads import in_threads, shares

SPEC: dict[str, Any] = json.loads((PACKAGED_TOKENIZER / "tokenizer.json").read_text())


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    return Tokenizer.from_file(str(PACKAGED_TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("trained-tokenizer"))


@pytest.fixture(scope="module")
def trained(trained_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(trained_dir / "tokenizer.json"))


def test_trained_tokenizer_would_catch_a_cut_inside_whitespace(trained: Tokenizer) -> None:
    """The guard for the tests below: a looser rule (any space, a cut inside a whitespace
    run) fails on this tokenizer."""
    for text, cut in (("a   b", 2), ("a\n\n\nb", 2)):
        assert _ids(trained, text[:cut]) + _ids(trained, text[cut:]) != _ids(trained, text)


def _ids(tok: Tokenizer, text: str, specials: bool = False) -> list[int]:
    return list(tok.encode(text, add_special_tokens=specials).ids)


def _check_every_cut(tok: Tokenizer, text: str) -> None:
    whole = _ids(tok, text)
    for cut in cut_points(text, 1):
        assert _ids(tok, text[:cut]) + _ids(tok, text[cut:]) == whole, (text, cut)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts)
def test_every_cut_of_fragment_texts_splits_exactly(
    raw: Tokenizer, trained: Tokenizer, text: str
) -> None:
    _check_every_cut(raw, text)
    _check_every_cut(trained, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_texts)
def test_every_cut_of_arbitrary_unicode_splits_exactly(
    raw: Tokenizer, trained: Tokenizer, text: str
) -> None:
    _check_every_cut(raw, text)
    _check_every_cut(trained, text)


def test_cuts_are_spaces_after_non_spaces() -> None:
    text = "ab  c\n d\xa0 e 'f"
    assert cut_points(text, 1) == [2, 11]  # not after a space, a newline or a no-break space
    assert pieces(text, 1) == ["ab", "  c\n d\xa0 e", " 'f"]
    assert "".join(pieces(text, 3)) == text


def test_cuts_depend_only_on_the_text_before_them() -> None:
    doc = filler_text(800)
    a, b = doc + " first question", doc + " second, longer question"
    shared = [c for c in cut_points(a, 64) if c < len(doc)]
    assert shared and shared == [c for c in cut_points(b, 64) if c < len(doc)]


def filler_text(tokens: int, seed: int = 3) -> str:
    return filler(LocalTokenizer(PACKAGED_TOKENIZER), tokens, random.Random(seed))


# ---- the tokenizer: pieces, caches, threads ----------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=texts,
    tails=st.lists(st.tuples(st.integers(0, 400), texts), min_size=1, max_size=6),
    piece_chars=st.sampled_from([1, 4, 16]),
)
def test_prompts_sharing_prefixes_match_full_tokenization(
    trained_dir: Path, base: str, tails: list[tuple[int, str]], piece_chars: int
) -> None:
    for folder in (PACKAGED_TOKENIZER, trained_dir):
        tok = LocalTokenizer(folder, piece_chars=piece_chars)
        raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert tok.split is not None
        for keep, tail in tails:
            prompt = base[:keep] + tail
            assert tok.completion(prompt) == _ids(raw, prompt, specials=True), prompt


def test_known_prefix_is_reused_not_re_encoded(raw: Tokenizer) -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=64)
    doc = filler_text(1000)
    tails = (" What is a block?", " Where does the prefix live?", " And the tail?", " Why?")
    for n, tail in enumerate(tails):
        assert tok.completion(doc + tail) == _ids(raw, doc + tail, specials=True)
        if n == 0:  # seen once: nothing kept, nothing reused
            assert len(tok.pieces) == 0 and tok.pieces.hits == 0
        if n == 1:  # seen twice: the shared pieces are kept
            assert len(tok.pieces) >= len(cut_points(doc, 64)) - 1 and tok.pieces.hits == 0
    assert tok.pieces.hits >= 2 * (len(cut_points(doc, 64)) - 1)


def test_distinct_prompts_keep_nothing(raw: Tokenizer) -> None:
    """A flood of prompts that share nothing churns neither cache, and each is encoded as
    one text: what the walk leaves is joined into at most WAYS runs."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=64, inline_chars=0)
    sizer, rng = LocalTokenizer(PACKAGED_TOKENIZER), random.Random(3)
    for i in range(40):
        prompt = f"{i}: " + filler(sizer, 300, rng)
        plan = tok._plan(prompt)
        assert plan.walk.admit == 0 and len(plan.texts) <= tokenize_threads.WAYS
        assert tok.completion(prompt) == _ids(raw, prompt, specials=True)
    assert len(tok.pieces) == 0 and len(tok.cache) == 0 and tok.pieces.bytes == 0


def test_only_the_text_after_the_shared_part_is_encoded() -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=256, fine_chars=32)
    doc = filler_text(1000)

    def walk(text: str) -> Walk:
        return tok.pieces.walk(pieces(text, 256), lambda p: pieces(p, 32))

    for tail in ("", " first tail", " second tail", " and a third"):
        tok.completion(doc + tail)
    third = walk(doc + " the third question here")
    assert sum(map(len, third.rest)) <= len(" the third question here") + 2 * 32
    # one step per coarse piece before the split one, even those first stored as fine ones
    assert third.split is not None
    assert len(third.known) - third.split[2] <= len(pieces(doc, 256)) - 1


def test_async_paths_equal_sync_inline_and_threaded(raw: Tokenizer) -> None:
    doc = filler_text(600)
    chat = [{"role": "system", "content": doc}, {"role": "user", "content": "Hi there, router"}]
    for inline in (0, 10**9):  # always the thread, never the thread
        tok = LocalTokenizer(PACKAGED_TOKENIZER, inline_chars=inline)
        ref = LocalTokenizer(PACKAGED_TOKENIZER)

        async def both(tok: LocalTokenizer = tok) -> tuple[list[int], list[int]]:
            a = await tok.acompletion(doc + " tail")
            b = await tok.achat(chat)
            return list(a), list(b)

        got = asyncio.run(both())
        assert got[0] == _ids(raw, doc + " tail", specials=True)
        assert got[1] == ref.chat(chat) == _ids(raw, ref.render_chat(chat))


def test_concurrent_async_requests_sharing_a_prefix(raw: Tokenizer) -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER, inline_chars=0)
    doc = filler_text(800)
    prompts = [doc + f" question {i} about blocks" for i in range(12)]

    async def run() -> list[list[int]]:
        found = await asyncio.gather(*(tok.acompletion(p) for p in prompts))
        return [list(f) for f in found]

    assert asyncio.run(run()) == [_ids(raw, p, specials=True) for p in prompts]
    for _ in range(2):  # kept from the second sighting on, a hit on the third
        again = asyncio.run(tok.acompletion(prompts[3]))
    assert (
        isinstance(again, Tokens)
        and tok.cache.hits >= 1
        and list(again) == _ids(raw, prompts[3], specials=True)
    )


def test_repeated_prompt_returns_the_same_tokens_with_their_hash_memo() -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER)

    async def thrice() -> list[Any]:
        return [await tok.acompletion("same prompt again") for _ in range(3)]

    first, second, third = asyncio.run(thrice())
    assert first is not second  # kept from its second sighting on
    assert second is third and hasattr(second, "hash_memo")
    assert list(first) == list(second)


# ---- bounded, out of the collector's way -------------------------------------------------


def test_store_values_are_not_tracked_by_the_collector() -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=64)
    tok.completion(filler_text(500))
    tok.completion(filler_text(500) + " again")
    gc.collect()
    nodes = list(tok.pieces._nodes.items())
    assert nodes and not any(gc.is_tracked(k) or gc.is_tracked(v) for k, v in nodes)


def test_a_huge_prompt_keeps_only_its_share(raw: Tokenizer) -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    tok.pieces = PieceStore(max_bytes=1 << 20, max_prompt_bytes=64 << 10)
    tok.cache = TokenCache(max_items=16, max_tokens=40_000)
    huge = "word " * 100_000  # 500 kB, ~100k tokens
    for _ in range(2):  # kept from the second sighting on
        assert tok.completion(huge) == _ids(raw, huge, specials=True)
    assert 0 < tok.pieces.bytes <= 64 << 10
    assert len(tok.cache) == 0  # above max_tokens // 16: not kept whole


def test_piece_store_evicts_to_its_budget() -> None:
    store = PieceStore(max_bytes=10_000, max_prompt_bytes=10_000)
    for i in range(200):
        store.add(Walk(rest=[f"piece {i} " * 4], admit=1), [bytes(400)])
    assert 0 < store.bytes <= 10_000 and len(store) < 200


def test_token_cache_is_bounded_in_tokens() -> None:
    cache = TokenCache(max_items=100, max_tokens=960)
    for i in range(20):
        cache.put(f"prompt {i}", list(range(60)))
        assert cache.get(f"prompt {i}") is None  # kept from the second sighting on
        cache.put(f"prompt {i}", list(range(60)))
    assert cache.tokens <= 960 and len(cache) == 16
    assert cache.get("prompt 19") is not None and cache.get("prompt 0") is None
    cache.put("big", list(range(61)))  # above max_tokens // 16: not kept
    assert cache.get("big") is None


# ---- where the proof does not hold: whole prompts only -----------------------------------


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param({"normalizer": {"type": "NFC"}}, "normalizer", id="normalizer"),
        pytest.param(
            {"pre_tokenizer": {**SPEC["pre_tokenizer"], "add_prefix_space": True}},
            "pre_tokenizer",
            id="prefix-space",
        ),
        pytest.param({"model": {**SPEC["model"], "dropout": 0.1}}, "dropout", id="dropout"),
        pytest.param(
            {"added_tokens": [{**SPEC["added_tokens"][0], "rstrip": True}]}, "strips", id="rstrip"
        ),
        pytest.param(
            {"added_tokens": [{**SPEC["added_tokens"][0], "content": "<a b>"}]},
            "whitespace",
            id="space-in-token",
        ),
        pytest.param(
            {"post_processor": {"type": "BertProcessing", "sep": ["</s>", 1], "cls": ["<s>", 0]}},
            "BertProcessing",
            id="bert",
        ),
    ],
)
def test_unsupported_tokenizers_say_why(change: dict[str, Any], reason: str) -> None:
    found = splittable({**SPEC, **change})
    assert isinstance(found, str) and reason in found


def test_packaged_tokenizer_is_splittable_with_bos_head() -> None:
    assert splittable(SPEC) == Splittable(head=(0,), tail=())


def test_unsupported_tokenizer_encodes_whole_and_stays_exact(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PACKAGED_TOKENIZER / name, tmp_path / name)
    spec = {**SPEC, "pre_tokenizer": {**SPEC["pre_tokenizer"], "add_prefix_space": True}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = LocalTokenizer(tmp_path, piece_chars=8)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    doc = filler_text(300)
    for prompt in (doc + " one", doc + " two"):
        assert tok.completion(prompt) == _ids(raw, prompt, specials=True)
        assert asyncio.run(tok.acompletion(prompt + "!")) == Tokens(
            _ids(raw, prompt + "!", specials=True)
        )
    assert tok.split is None and len(tok.pieces) == 0


# ---- threads -------------------------------------------------------------------------------


def test_shares_are_contiguous_and_balanced() -> None:
    items = ["a" * n for n in (5, 1, 1, 1, 5, 3, 4)]
    runs = shares(items, 2)
    assert [x for run in runs for x in run] == items and len(runs) == 2
    assert abs(sum(map(len, runs[0])) - sum(map(len, runs[1]))) <= 5


def test_spread_over_threads_keeps_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenize_threads, "WAYS", 3)
    seen: list[list[str]] = []

    def fn(run: list[str]) -> list[str]:
        seen.append(run)
        return [s.upper() for s in run]

    items = [f"piece{i}" for i in range(10)]
    assert asyncio.run(in_threads(fn, items)) == [s.upper() for s in items]
    assert len(seen) == 3  # nothing else in flight: spread
    seen.clear()
    assert asyncio.run(in_threads(fn, items, spread=False)) == [s.upper() for s in items]
    assert len(seen) == 1


def test_memoized_block_hashes_are_kept_as_tuples_out_of_the_collectors_way() -> None:
    """The picker stores lists in `hash_memo`; a full collection would walk them."""
    tokens = Tokens(range(64))
    tokens.hash_memo[(16, "ns")] = [1, 2, 3, 4]
    stored = tokens.hash_memo[(16, "ns")]
    assert stored == (1, 2, 3, 4)
    gc.collect()
    assert not gc.is_tracked(stored)


def test_seen_keys_keep_two_keys_that_share_a_slot() -> None:
    seen = SeenKeys(1 << 4)
    a, b, c = 5, 5 + (3 << 40), 5 + (19 << 40)  # one first slot (5); second 0, 3 and 3
    assert seen.first_sighting(a) and seen.first_sighting(b)
    assert seen.seen(a) and seen.seen(b)
    assert seen.first_sighting(c)  # both of c's slots are taken: it pushes a out
    assert seen.seen(c) and seen.seen(b) and not seen.seen(a)
    assert seen.first_sighting(0) and not seen.first_sighting(0)


# ---- block hashes of a shared prefix -----------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=texts,
    tails=st.lists(st.tuples(st.sampled_from([0, 5, 40, 400]), texts), min_size=3, max_size=10),
    piece_chars=st.sampled_from([1, 4, 16]),
    chat=st.booleans(),
)
def test_hashes_reusing_a_shared_prefix_equal_hashing_the_whole_prompt(
    base: str, tails: list[tuple[int, str]], piece_chars: int, chat: bool
) -> None:
    """Distinct prompts over shared prefixes (never the same prompt twice, so no whole-prompt
    cache answers): each one's memoized hashes (its shared prefix's blocks from the prefix's
    memo, only the rest hashed) equal the chain over its plain ids, at block sizes that put
    the prefix's end at every offset inside a block."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=piece_chars, fine_chars=piece_chars)
    ns = Namespace("m", cache_salt="s")
    for n, (keep, tail) in enumerate(tails * 2):
        text = f"{base[:keep]} {_OPENINGS[n]}{tail}"  # the tails part at their first token
        if chat:  # the template places the specials itself
            text = tok.render_chat([{"role": "user", "content": text}])
        tokens = tok._tokens((chat, text), text, specials=not chat)
        for bs in (1, 3, 16):
            assert list(_hashes(tokens, bs, ns)) == hash_request(list(tokens), bs, ns)


_OPENINGS = [
    "apple",
    "blue",
    "cat",
    "dog",
    "egg",
    "fox",
    "gold",
    "hat",
    "ice",
    "jam",
    "kite",
    "lamp",
    "moon",
    "nut",
    "owl",
    "pig",
    "queen",
    "rat",
    "sun",
    "top",
]


def test_a_new_tail_after_a_known_document_hashes_only_its_own_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    doc, ns = filler_text(2000), Namespace("m")
    hashed: list[int] = []
    real = picker_module.hash_blocks

    def counting(tokens: Any, bs: int, seed: int) -> list[Any]:
        hashed.append(len(tokens))
        return real(tokens, bs, seed)

    monkeypatch.setattr(picker_module, "hash_blocks", counting)
    for i in range(5):
        prompt = f"{doc} question {i} about caches"
        tokens = tok._tokens(("c", prompt), prompt, specials=True)
        assert list(_hashes(tokens, 16, ns)) == hash_request(list(tokens), 16, ns)
    assert tokens.shared_prefix is not None and tokens.shared_prefix[0] > 1900
    assert hashed and hashed[-1] < 100  # the tail after the prefix's last full block


def test_a_prompt_that_does_not_cut_where_an_anchor_did_is_walked_from_the_root(
    raw: Tokenizer,
) -> None:
    """An anchor names a prefix ending at a cut, the cut's own character included: a
    prompt that shares the text before the cut but goes on without the space there is cut
    elsewhere, and must not resume from it (its tokens would be the prefix's plus the rest's,
    split inside a word)."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=8, fine_chars=8)
    doc = filler_text(300)
    for tail in (" one", " two", " three"):
        tok.completion(doc + tail)
    anchors = [a for found in tok.anchors._by_key.values() for a in found]
    assert anchors and all(a.text[-1] == " " for a in anchors)
    longest = tok.anchors.find(doc + " four")  # the next question skips the known document
    assert longest is not None and len(longest.text) > len(doc) - 3 * 8
    for a in anchors:
        for joined in ("s are", "ing", "ed on", "ly"):
            prompt = a.text[:-1] + joined
            assert tok.completion(prompt) == _ids(raw, prompt, specials=True), prompt


def test_anchors_stay_within_their_budget_and_keep_the_newest() -> None:
    """Many documents after one opening: at most PER_KEY anchors per opening, no more
    characters than the budget in all, and the newest document's anchor always kept."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=16, fine_chars=16)
    tok.anchors.max_chars = 3000
    opening = filler_text(40)
    for d in range(30):
        doc = f"{opening} document {d}: " + filler_text(120, seed=d)
        for q in range(3):
            tok.completion(f"{doc} question {q}")
        assert tok.anchors.chars <= 3000
        assert tok.anchors.chars == sum(
            len(a.text) for found in tok.anchors._by_key.values() for a in found
        )
        newest = tok.anchors.find(f"{doc} question 7")
        assert newest is not None and f"document {d}:" in newest.text
    assert all(len(found) <= tok.anchors.PER_KEY for found in tok.anchors._by_key.values())


def test_prefix_memos_stay_within_their_bounds_newest_kept() -> None:
    """The shared prefixes' hash memos are an LRU bounded in items and in prefix tokens."""
    memos = PrefixMemos(max_items=4, max_tokens=1000)
    for node in range(10):
        memos.get(node, True, 300)
        assert memos.tokens <= 1000 and len(memos._items) <= 4
    latest = memos.get(9, True, 300)
    assert memos.get(9, True, 300) is latest and memos.get(9, False, 300) is not latest
    assert memos.get(0, True, 300)[1] == {} and (0, True) in memos._items  # made again
