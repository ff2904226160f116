"""Word ids (`router.tokenize_words`) are exact: a text's ids joined from its words, each
encoded alone, equal the tokenizer's own for random texts (the fragments that stress the
GPT-2 regex, arbitrary unicode) with the packaged tokenizer and one trained on
whitespace-heavy text; the cache stays bounded and stops learning from text it cannot
help."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_texts import any_texts, texts, train_tokenizer
from tokenizers import Tokenizer

from router.textgen import WORDS
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer
from router.tokenize_split import pieces
from router.tokenize_words import WordIds, _keys, words


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    return Tokenizer.from_file(str(PACKAGED_TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = train_tokenizer(tmp_path_factory.mktemp("trained-tokenizer"))
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _encoder(
    tok: Tokenizer,
    calls: list[list[str]] | None = None,
    max_words: int = 1 << 12,
    learn: int = 1 << 10,
) -> WordIds:
    def encode(batch: list[str]) -> list[bytes]:
        if calls is not None:
            calls.append(batch)
        found = tok.encode_batch_fast(batch, add_special_tokens=False)
        return [array("I", e.ids).tobytes() for e in found]

    return WordIds(encode, max_words=max_words, learn=learn)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _as_list(raw_ids: bytes | None) -> list[int] | None:
    return None if raw_ids is None else array("I", raw_ids).tolist()


def test_words_are_the_cuts_at_every_safe_point() -> None:
    for text in ("ab  c\n d\xa0 e 'f", " lead", "", "x", "a b  c", "tail "):
        assert words(text) == pieces(text, 1)
        assert "".join(words(text)) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(texts, any_texts), min_size=1, max_size=4))
def test_ids_from_words_equal_the_tokenizers(
    raw: Tokenizer, trained: Tokenizer, batch: list[str]
) -> None:
    """Texts one after another through one cache, each twice: the first time the cache
    may leave it to the caller (and learns its words), the second it answers; later texts
    meet words learned from earlier ones, in other company."""
    for tok in (raw, trained):
        cache = _encoder(tok)
        for text in batch:
            first = cache.ids(text)
            assert first is None or _as_list(first) == _ids(tok, text), text
            assert _as_list(cache.ids(text)) == _ids(tok, text), text


def test_known_words_need_no_tokenizer_call(raw: Tokenizer) -> None:
    calls: list[list[str]] = []
    cache = _encoder(raw, calls)
    rng = random.Random(1)
    texts = ["Q: " + " ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(3)]
    assert cache.ids(texts[0]) is None  # all new: left to the caller, its opening learned
    assert _as_list(cache.ids(texts[1])) == _ids(raw, texts[1])  # the rest learned
    n = len(calls)
    assert _as_list(cache.ids(texts[2])) == _ids(raw, texts[2])
    assert len(calls) == n  # every word known: no tokenizer call
    assert cache.hits == 2 and cache.misses == 1


def test_text_mostly_of_new_words_is_left_to_the_caller(raw: Tokenizer) -> None:
    calls: list[list[str]] = []
    cache = _encoder(raw, calls, max_words=400, learn=8)
    novel = " ".join(f"w{i}x" for i in range(100))
    assert cache.ids(novel) is None and cache.misses == 1
    assert 0 < len(cache) < 100  # its opening words learned, not the rest
    while len(cache) < cache.max_words // 4:  # young: every such text teaches its opening
        assert cache.ids(" ".join(f"z{len(cache)}q{i}" for i in range(60))) is None
    # grown: after a text mostly of new words the next COOLDOWN are not even looked at
    n, size = len(calls), len(cache)
    for k in range(cache.COOLDOWN):
        assert cache.ids(" ".join(f"n{k}m{i}" for i in range(60))) is None
    assert len(calls) == n and len(cache) == size
    # then it looks again: a text of known words is answered
    known = " ".join(f"w{i}x" for i in range(8))
    assert _as_list(cache.ids(known)) == _ids(raw, known)
    # and a new vocabulary that keeps coming is learned from the texts it does look at
    fresh = [" ".join(f"v{i % 9}y" for i in range(k, k + 40)) for k in range(20)]
    answered = [cache.ids(t) for t in fresh]
    assert answered[-1] is not None and _as_list(answered[-1]) == _ids(raw, fresh[-1])


def test_bounded_it_starts_over(raw: Tokenizer) -> None:
    cache = _encoder(raw, max_words=64, learn=32)
    for k in range(40):
        text = " ".join(f"q{k}r{i}" for i in range(20))
        for _ in range(2):
            got = cache.ids(text)
            assert got is None or _as_list(got) == _ids(raw, text)
            assert len(cache) <= 64


def _kept_chars(cache: WordIds) -> list[int]:
    return [len(k) for k in (*cache._spaced, *cache._first)]


@pytest.mark.parametrize("where", ["after a first word", "first"])
def test_long_words_are_answered_but_not_kept(raw: Tokenizer, where: str) -> None:
    """A run without spaces (Chinese, base64) is one word that seldom comes back: kept, 3,000
    distinct 3,000-character prompts held 126 MB."""
    cache = _encoder(raw)
    rng = random.Random(3)
    head = "Translate this: " if where != "first" else ""
    for _ in range(20):
        body = "".join(chr(0x4E00 + rng.randrange(3000)) for _ in range(3000))
        text = f"{head}{body} and {body[:5]}"
        got = cache.ids(text)
        assert got is None or _as_list(got) == _ids(raw, text)
    assert max(_kept_chars(cache)) <= WordIds.MAX_WORD_CHARS
    assert cache.chars == sum(_kept_chars(cache)) < 200


def test_kept_characters_are_bounded(raw: Tokenizer) -> None:
    cache = WordIds(_encoder(raw)._encode, max_chars=4000, learn=1 << 10)
    for k in range(40):
        text = " ".join(f"w{k}x{i}{'z' * 100}" for i in range(8))
        got = cache.ids(text)
        assert got is None or _as_list(got) == _ids(raw, text)
        assert cache.chars == sum(_kept_chars(cache)) <= 4000


def test_tokenizer_answers_distinct_prompts_from_words(raw: Tokenizer) -> None:
    """Through LocalTokenizer: prompts that share nothing but their vocabulary are joined
    from known words (no tokenizer call once the words are known), and stay exact."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    rng = random.Random(5)
    for i in range(30):
        prompt = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(400))
        assert tok.completion(prompt) == list(raw.encode(prompt).ids)
    assert tok.words.hits >= 28 and len(tok.pieces) == 0


@settings(max_examples=500, deadline=None)
@given(st.one_of(texts, any_texts, st.text(alphabet=" ab\n\t\xa0", max_size=30)))
def test_keys_are_the_words(text: str) -> None:
    """The fast split finds exactly the regex's words."""
    if not text:
        return
    first, rest = _keys(text)
    rebuilt = ([first] if first is not None else []) + [" " + k for k in rest]
    assert rebuilt == words(text)
