"""kvroute reads integer request fields as vLLM's pydantic models do (lax mode): held to
pydantic itself on random values, and through the parser every door uses."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError

from engines.vllm.lax import NotABool, NotAnInt, lax_bool, lax_int
from router.core.errors import BadRequest
from router.openai_req import parse

PYDANTIC_INT = TypeAdapter(int)
PYDANTIC_BOOL = TypeAdapter(bool)

NUMBERISH = st.text(alphabet="0123456789_.+-eE x\t\n\x1c\x85\u00a0\u2003\u0663", max_size=12)
VALUES = st.one_of(
    st.integers(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e20, max_value=1e20).map(round).map(float),
    NUMBERISH,
    st.integers(-(10**6), 10**6).map(str),
    st.integers(0, 10**6).map(lambda i: f" {i}.{'0' * (i % 3 + 1)} "),
    st.sampled_from([-(2.0**63), 2.0**63, float(2**63 - 1024), -float(2**63 - 1024)]),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


LONG_DIGITS = st.builds(
    lambda lead, n, sep, tail: lead + sep.join(["1"] * n) + tail,
    st.sampled_from(["", "-", "+", " ", "0" * 9, "-" + "0" * 9]),
    st.integers(4295, 4305),
    st.sampled_from(["", "_"]),
    st.sampled_from(["", ".0", " ", ".5"]),
)


@settings(max_examples=200, deadline=None)
@given(LONG_DIGITS)
def test_integer_text_past_4300_digits_is_refused_or_read_as_pydantic_does(text: str) -> None:
    # Python's int() raises a bare ValueError past 4,300 digits: it was a 500 at the router
    try:
        want: int | None = PYDANTIC_INT.validate_python(text)
    except ValidationError:
        want = None
    try:
        got: int | None = lax_int(text)
    except NotAnInt:
        got = None
    assert got == want, text[:12]


@settings(max_examples=2000, deadline=None)
@given(VALUES)
def test_lax_int_takes_and_refuses_what_pydantic_does(value: object) -> None:
    try:
        want: int | None = PYDANTIC_INT.validate_python(value)
        code = None
    except ValidationError as exc:
        want, code = None, exc.errors()[0]["type"]
    try:
        got: int | None = lax_int(value)
        got_code = None
    except NotAnInt as exc:
        got, got_code = None, exc.code
    assert (got, got_code) == (want, code), repr(value)


BOOLISH = st.one_of(
    st.sampled_from(["true", "FALSE", "On", "off", "y", "N", "t", "f", "1", "0", "yes", "No"]),
    st.text(alphabet="tTrRuUeEfFaAlLsSyYnNoO01 ", max_size=6),
    st.integers(-2, 2),
    st.integers(),
    st.floats(-2, 2),
    st.floats(),
    st.sampled_from([2.0**63, -(2.0**63), 2**63, -(2**63), 1e300]),
    st.sampled_from([0.0, 1.0, -0.0, float("nan")]),
    st.none(),
    st.lists(st.booleans(), max_size=1),
)


@settings(max_examples=1000, deadline=None)
@given(BOOLISH)
def test_lax_bool_takes_and_refuses_what_pydantic_does(value: object) -> None:
    try:
        want: bool | None = PYDANTIC_BOOL.validate_python(value)
        code = msg = None
    except ValidationError as exc:
        want, code, msg = None, exc.errors()[0]["type"], exc.errors()[0]["msg"]
    try:
        got: bool | None = lax_bool(value)
        got_code = got_msg = None
    except NotABool as exc:
        got, got_code, got_msg = None, exc.code, str(exc)
    assert (got, got_code, got_msg) == (want, code, msg), repr(value)


@pytest.mark.parametrize(
    ("value", "stream"),
    [("false", False), ("0", False), (None, False), (0.0, False), ("yes", True), (1, True)],
)
def test_stream_is_read_as_vllm_reads_it(value: object, stream: bool) -> None:
    # "false" read as truthy relayed a JSON answer as a stream
    body = {"model": "m", "prompt": "hi", "stream": value}
    assert parse("completion", json.dumps(body).encode()).stream is stream


def test_a_stream_flag_vllm_refuses_is_a_400() -> None:
    body = {"model": "m", "prompt": "hi", "stream": "maybe"}
    with pytest.raises(BadRequest) as caught:
        parse("completion", json.dumps(body).encode())
    assert caught.value.param == "stream"


@pytest.mark.parametrize(
    ("value", "want"),
    [("16", 16), (" 16 ", 16), ("1_6", 16), ("16.0", 16), (16.0, 16), (True, 1), ("+5", 5)],
)
def test_the_parser_takes_numbers_vllm_takes(value: object, want: int) -> None:
    for field, read in (
        ("max_tokens", lambda r: r.max_tokens),
        ("n", lambda r: r.n),
        ("truncate_prompt_tokens", lambda r: r.truncate_prompt_tokens),
    ):
        body = {"model": "m", "prompt": "hi", field: value}
        assert read(parse("completion", json.dumps(body).encode())) == want, field
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = chat | {"max_completion_tokens": value}
    assert parse("chat", json.dumps(body).encode()).max_tokens == want


@pytest.mark.parametrize("value", ["16.5", 16.5, "1e2", "0x10", "", [1], {"a": 1}])
def test_the_parser_refuses_what_vllm_refuses_naming_the_field(value: object) -> None:
    for field in ("max_tokens", "n", "truncate_prompt_tokens"):
        body = {"model": "m", "prompt": "hi", field: value}
        with pytest.raises(BadRequest) as caught:
            parse("completion", json.dumps(body).encode())
        assert caught.value.param == field and field in str(caught.value)


def test_a_zero_max_tokens_as_text_reserves_no_output() -> None:
    # "0" is 0 to vLLM: a -1 truncation then keeps the whole context for the prompt
    body = {"model": "m", "prompt": "hi", "max_tokens": "0", "truncate_prompt_tokens": "-1"}
    r = parse("completion", json.dumps(body).encode())
    assert r.max_tokens == 0 and r.output_reserved is False and r.truncate_prompt_tokens == -1


def test_a_completion_ignores_max_completion_tokens_as_vllm_does() -> None:
    # vLLM's CompletionRequest has no such field: it keeps it as an unknown one, unused
    body = {"model": "m", "prompt": "hi", "max_completion_tokens": 100, "max_tokens": 5}
    assert parse("completion", json.dumps(body).encode()).max_tokens == 5
    body = {"model": "m", "prompt": "hi", "max_completion_tokens": "abc"}
    assert parse("completion", json.dumps(body).encode()).max_tokens == 16


# vLLM 0.32's CompletionRequest.prompt, ids as `Annotated[int, Field(ge=0)]`
_ID = Annotated[int, Field(ge=0)]
PYDANTIC_PROMPT = TypeAdapter(list[_ID] | list[list[_ID]] | str | list[str])
ID_ISH = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(-3, -1),
    st.booleans(),
    st.integers(0, 999).map(float),
    st.sampled_from([1.5, "7", " 8 ", "x", "", None]),
)
PROMPTS = st.one_of(
    st.text(max_size=5),
    st.lists(ID_ISH, max_size=4),
    st.lists(st.lists(ID_ISH, max_size=3), max_size=3),
    st.lists(st.one_of(st.text(max_size=3), st.lists(ID_ISH, max_size=2)), max_size=3),
    st.integers(),
)


@settings(max_examples=1500, deadline=None)
@given(PROMPTS)
def test_a_prompt_is_read_as_vllms_request_model_reads_it(prompt: object) -> None:
    """Token ids given as 1.0, true or "7" are ids to vLLM (lax mode); what it refuses,
    kvroute refuses. An empty prompt (vLLM refuses it later) is refused by both."""
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    try:
        want = PYDANTIC_PROMPT.validate_python(prompt)
    except ValidationError:
        with pytest.raises(BadRequest):
            parse("completion", body)
        return
    first = (
        want[0] if isinstance(want, list) and want and isinstance(want[0], (str, list)) else want
    )
    batch = len(want) if first is not want else 1
    if first == [] or (isinstance(want, list) and not want):
        with pytest.raises(BadRequest):
            parse("completion", body)
        return
    got = parse("completion", body)
    assert (got.prompt_text, got.prompt_ids, got.n) == (
        (first, None, batch) if isinstance(first, str) else (None, first, batch)
    )


def test_a_null_model_is_the_engines_default_and_a_bom_is_skipped() -> None:
    assert parse("completion", b'{"model": null, "prompt": "hi"}').model == ""
    bom = b"\xef\xbb\xbf" + json.dumps({"model": "m", "prompt": "hi"}).encode()
    assert parse("completion", bom).prompt_text == "hi"
    with pytest.raises(BadRequest, match="'model' must be a string"):
        parse("completion", b'{"model": 5, "prompt": "hi"}')


def test_prompt_embeds_without_a_prompt_route_by_model_and_load() -> None:
    got = parse("completion", b'{"model": "m", "prompt_embeds": "AAAA", "stream": true}')
    assert (got.kind, got.model, got.stream) == ("none", "m", True)
    with pytest.raises(BadRequest, match="'prompt'"):
        parse("completion", b'{"model": "m"}')
