"""Integer and boolean request fields as vLLM's request models read them.

vLLM validates a request with pydantic in its default (lax) mode, so an integer field
(`max_tokens`, `n`, `truncate_prompt_tokens`, ...) also takes `"16"`, `" 16 "`, `"1_6"`,
`"16.0"`, `16.0` and `true`, and refuses `16.5`, `"16.5"`, `"1e2"` and `"0x10"`; a boolean
field (`stream`, `add_special_tokens`, ...) takes `"false"`, `"off"`, `0` and `0.0` as
false. A router that takes only JSON integers refuses requests the engine serves; one that
reads `"0"` or `"false"` as truthy counts output the engine does not, or relays a JSON
answer as a stream. Checked against vLLM 0.32's `CompletionRequest` and
`ChatCompletionRequest` (`tests/test_lax_int.py` holds this to pydantic itself).
"""

from __future__ import annotations

import math
import re

# optional sign, ASCII digits with single underscores between them, and a zero fraction
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_I64 = 2**63  # a float beyond a 64-bit integer is refused, as pydantic-core does
_PLAIN_INT = re.compile(r"-?[1-9][0-9]*")
_MAX_DIGITS = 4300  # pydantic-core's (and Python's) longest integer text
_NOT_INT = "Input should be a valid integer, unable to parse string as an integer"
_TOO_BIG = "Unable to parse input string as an integer, exceeded maximum size"
# Unicode White_Space, which pydantic-core trims (Rust's `str::trim`): Python's own strip()
# also trims \x1c-\x1f, which pydantic refuses
_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
_SPACE += "\u2028\u2029\u202f\u205f\u3000"


class NotAnInt(ValueError):
    """The value is no integer to vLLM; `code` is pydantic's error type."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def lax_int(value: object) -> int:
    """`value` as vLLM reads an integer field; raises NotAnInt as it would refuse it."""
    if isinstance(value, int):  # bool included: true is 1
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotAnInt("finite_number", "Input should be a finite number")
        if not value.is_integer():
            raise NotAnInt(
                "int_from_float",
                "Input should be a valid integer, got a number with a fractional part",
            )
        if not -_I64 < value < _I64:
            raise NotAnInt("int_parsing_size", _TOO_BIG)
        return int(value)
    if isinstance(value, str):
        text = value.strip(_SPACE)
        if _INT_TEXT.fullmatch(text) is None:
            raise NotAnInt("int_parsing", _NOT_INT)
        whole = text.split(".", 1)[0]
        sign = "-" if whole.startswith("-") else ""
        plain = whole.lstrip("+-")
        digits = plain.replace("_", "").lstrip("0") or "0"
        if len(digits) > _MAX_DIGITS:  # Python's int() refuses these with a ValueError
            # refused as pydantic-core refuses it; its error type here follows rules of its
            # own (mostly "size" for text that opens with plain digits), approximated
            if _PLAIN_INT.match(value) and "_" not in value:
                raise NotAnInt("int_parsing_size", _TOO_BIG)
            raise NotAnInt("int_parsing", _NOT_INT)
        return int(sign + digits)
    raise NotAnInt("int_type", "Input should be a valid integer")


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


class NotABool(ValueError):
    """The value is no boolean to vLLM; `code` is pydantic's error type."""

    def __init__(self, code: str) -> None:
        tail = ", unable to interpret input" if code == "bool_parsing" else ""
        super().__init__(f"Input should be a valid boolean{tail}")
        self.code = code


def lax_bool(value: object) -> bool:
    """`value` as vLLM reads a boolean field; raises NotABool as it would refuse it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise NotABool("bool_parsing")
    # a whole number in 64 bits other than 0 or 1 is "parsing", anything else "type" (a
    # float's range is open at both ends, as for integers)
    if isinstance(value, int):
        in_range = -_I64 <= value < _I64
    else:
        in_range = isinstance(value, float) and value.is_integer() and -_I64 < value < _I64
    raise NotABool("bool_parsing" if in_range else "bool_type")


class NotAPrompt(ValueError):
    """The value is no completion prompt to vLLM (its union refuses every member)."""


def lax_prompt(prompt: object) -> tuple[bool, list[str | list[int]]]:
    """A completion's `prompt` as vLLM 0.32's request model reads it: `list[int] |
    list[list[int]] | str | list[str]`, every member tried strictly first, then laxly in
    that order (pydantic's smart union), so `[1.0, 2.0]`, `[true, false]` and `["1", 2]`
    are token ids. Returns (whether it is a batch, its prompts); ids may be negative (the
    model's `ge=0` is the caller's to check), and a list may be empty. Raises NotAPrompt."""
    if isinstance(prompt, str):
        return False, [prompt]
    if not isinstance(prompt, list):
        raise NotAPrompt("the prompt is neither a string nor a list")
    if all(type(t) is int for t in prompt):
        return False, [prompt]
    if prompt and all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
        return True, list(prompt)
    if all(isinstance(p, str) for p in prompt):
        return True, list(prompt)
    ids = _lax_ids(prompt)
    if ids is not None:
        return False, [ids]
    if all(isinstance(p, list) for p in prompt):
        lists = [_lax_ids(p) for p in prompt]
        if all(p is not None for p in lists):
            return True, [p for p in lists if p is not None]
    raise NotAPrompt("the prompt is no string, token ids, or batch of either")


def _lax_ids(values: list[object]) -> list[int] | None:
    try:
        return [lax_int(t) for t in values]
    except NotAnInt:
        return None
