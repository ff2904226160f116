"""The committed tokenizer folder: ids, BOS handling, chat template, reproducibility.

Expected ids marked "real vLLM" were returned by vLLM 0.32.0's /tokenize serving this folder
(conformance/vllm_server.py); they pin the router's local tokenization to the engine's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizer_texts import any_texts
from tokenizers import Tokenizer

from engines.sim import make_tokenizer
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer, Tokens
from router.tokenize_split import cut_points
from router.tokenizers import TokenizerSet

TOKENIZER_DIR = make_tokenizer.DEFAULT_OUT
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Route me."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    return data


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def render_chat(config: dict[str, Any], messages: list[dict[str, str]], gen: bool) -> str:
    """Render the way transformers' apply_chat_template does (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    template = env.from_string(config["chat_template"])
    specials = {"bos_token": config["bos_token"], "eos_token": config["eos_token"]}
    return template.render(messages=messages, add_generation_prompt=gen, **specials)


@pytest.mark.parametrize(
    ("token", "expected_id"),
    [("<s>", 0), ("</s>", 1), ("<|im_start|>", 2), ("<|im_end|>", 3)],
)
def test_special_token_ids(tokenizer: Tokenizer, token: str, expected_id: int) -> None:
    assert tokenizer.token_to_id(token) == expected_id


def test_vocabulary_size(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size(with_added_tokens=True) == make_tokenizer.VOCAB_SIZE


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        pytest.param(
            "Hello world, the router sends each request to a worker.",
            [
                0,
                43,
                570,
                82,
                990,
                15,
                299,
                1982,
                270,
                463,
                86,
                562,
                558,
                1798,
                329,
                276,
                673,
                265,
                17,
            ],
            id="english",
        ),
        pytest.param(
            "naïve café 🚀 — ünïcödé\nnew line",
            [
                *[0, 81, 68, 131, 111, 332, 482, 73, 131, 106, 224, 176, 257, 252, 226, 224, 162],
                *[
                    226,
                    246,
                    224,
                    131,
                    124,
                    81,
                    131,
                    111,
                    70,
                    131,
                    118,
                    71,
                    131,
                    106,
                    202,
                    1495,
                    833,
                ],
            ],
            id="non-ascii-bytes",
        ),
        pytest.param("", [0], id="empty"),
    ],
)
def test_completion_prompt_matches_real_vllm(
    tokenizer: Tokenizer, prompt: str, expected: list[int]
) -> None:
    assert tokenizer.encode(prompt).ids == expected
    # the router's path: cut at every safe point, pieces reused from prompts seen before
    # (pieces are kept from their second sighting on)
    local = LocalTokenizer(TOKENIZER_DIR, piece_chars=1)
    for tail in (" and a different tail", " and another one"):
        assert local.completion(prompt + tail) == tokenizer.encode(prompt + tail).ids
    assert local.completion(prompt) == expected
    assert local.pieces.hits >= len(cut_points(prompt, 1))


@pytest.mark.parametrize("prompt", ["hello", "The cache router.", " leading space", "a\n\nb"])
def test_completion_adds_exactly_one_bos(tokenizer: Tokenizer, prompt: str) -> None:
    with_bos = tokenizer.encode(prompt).ids
    bare = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert with_bos == [0, *bare]
    assert tokenizer.decode(bare) == prompt


def test_chat_template_text(config: dict[str, Any]) -> None:
    assert render_chat(config, CHAT[:2], gen=True) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    )


CHAT_IDS = [
    *[0, 2, 86, 475, 499, 202, 37, 72, 691, 981, 17, 3, 202, 2, 347, 265, 202, 43, 570, 82],
    *[990, 3, 202, 2, 852, 1057, 202, 43, 76, 17, 3, 202, 2, 347, 265, 202, 53, 345, 72],
    *[767, 17, 3, 202, 2, 852, 1057, 202],
]


def test_chat_tokens_match_real_vllm(tokenizer: Tokenizer, config: dict[str, Any]) -> None:
    # Chat prompts are encoded without automatic specials: the template carries the BOS.
    ids = tokenizer.encode(render_chat(config, CHAT, gen=True), add_special_tokens=False).ids
    assert ids == CHAT_IDS


def test_router_chat_path_matches_real_vllm() -> None:
    """Cut at every safe point, the earlier turns' pieces reused from shorter chats (kept
    from their second sighting on)."""
    local = LocalTokenizer(TOKENIZER_DIR, piece_chars=1)
    local.chat(CHAT[:2], add_generation_prompt=False)
    local.chat(CHAT[:3], add_generation_prompt=False)
    assert local.chat(CHAT) == CHAT_IDS
    assert local.pieces.hits > 0
    assert asyncio.run(local.achat(CHAT)) == Tokens(CHAT_IDS)


def test_chat_without_generation_prompt_ends_at_turn(
    tokenizer: Tokenizer, config: dict[str, Any]
) -> None:
    ids = tokenizer.encode(render_chat(config, CHAT[:2], gen=False), add_special_tokens=False).ids
    assert ids[-2:] == [3, 202]  # <|im_end|> "\n"
    assert ids.count(0) == 1


def test_chat_rejects_unknown_role(config: dict[str, Any]) -> None:
    with pytest.raises(jinja2.TemplateError, match="roles"):
        render_chat(config, [{"role": "tool", "content": "x"}], gen=True)


def test_config_files_agree(config: dict[str, Any]) -> None:
    specials = json.loads((TOKENIZER_DIR / "special_tokens_map.json").read_text())
    assert specials == {"bos_token": "<s>", "eos_token": "</s>"}
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    # transformers rebuilds the post-processor from these; they must say what tokenizer.json does.
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, False)
    assert config["model_max_length"] == 4096


def test_folder_is_small() -> None:
    assert sum((TOKENIZER_DIR / name).stat().st_size for name in FILES) < 300_000


def test_regenerating_reproduces_committed_bytes(tmp_path: Path) -> None:
    make_tokenizer.write_tokenizer_files(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes(), name


@settings(max_examples=200, deadline=None)
@given(st.lists(any_texts, max_size=4))
def test_the_length_floor_is_a_lower_bound_on_the_tokens(texts: list[str]) -> None:
    """The floor that refuses a prompt before tokenizing it counts UTF-8 bytes (an ASCII
    text by its length, without copying it) and never exceeds the real token count."""
    tok = _PACKAGED
    floor = _SET.min_tokens(tok, texts)
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    assert floor == -(-size // _LONGEST)
    if all(t.encode("utf-8", "surrogatepass") == t.encode("utf-8", "replace") for t in texts):
        assert floor <= sum(len(tok.completion(t)) for t in texts)


_PACKAGED = LocalTokenizer(PACKAGED_TOKENIZER)
# the longest vocabulary entry, read from the file itself rather than through the router
_DOC = json.loads((PACKAGED_TOKENIZER / "tokenizer.json").read_text())
_ENTRIES = [*_DOC["model"]["vocab"], *(a["content"] for a in _DOC["added_tokens"])]
_LONGEST = max(len(t.encode("utf-8", "surrogatepass")) for t in _ENTRIES)
_SET = TokenizerSet(None, preloaded=_PACKAGED)
