"""vLLM's error bodies, as its exception handlers write them.

`{"error": {"message", "type", "param", "code"}}`. Schema violations come out as vLLM's
RequestValidationError handler writes them (type "Bad Request", message "N validation
error(s): ..." with the `loc` joined and the `input` summarised, param "body.<field>");
`VLLMValidationError`s as `invalid` (type "BadRequestError", the message with
" (parameter=X, value=Y)" appended, param X); other semantic errors as `bad_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_INPUT_CHARS = 200  # vLLM's _MAX_ERROR_INPUT_CHARS


class ApiError(Exception):
    def __init__(self, message: str, err_type: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, "BadRequestError", 400, param)


def invalid(message: str, param: str | None = None, value: object = None) -> ApiError:
    """vLLM's `VLLMValidationError`: its str() appends the parameter and the value."""
    extras = [f"{k}={v}" for k, v in (("parameter", param), ("value", value)) if v is not None]
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(text, "BadRequestError", 400, param)


SchemaError = tuple[Sequence[str | int], str, str, object]  # (loc, type, msg, input)


def schema_errors(errors: Sequence[SchemaError], ctx: dict[str, Any] | None = None) -> ApiError:
    """pydantic validation errors, as vLLM's RequestValidationError handler says them; `ctx`
    goes with the first error (pydantic's constraint, e.g. {"ge": 0})."""
    lines = []
    for i, (loc, kind, msg, value) in enumerate(errors):
        err: dict[str, Any] = {"type": kind, "loc": _loc(loc), "msg": msg}
        err["input"] = summarise(value)
        if ctx and i == 0:
            err["ctx"] = ctx
        lines.append(f"  {err}")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    return ApiError(message, "Bad Request", 400, _loc(errors[0][0]))


def schema_error(
    loc: Sequence[str | int], kind: str, msg: str, value: object, ctx: dict[str, Any] | None = None
) -> ApiError:
    """One pydantic validation error; `value` is the field's input (the whole body when the
    field is missing)."""
    return schema_errors([(loc, kind, msg, value)], ctx)


def summarise(value: object) -> str:
    """vLLM's `_summarize_error_input`: containers described, long strings cut."""
    if isinstance(value, str):
        cut = len(value) > MAX_INPUT_CHARS
        return value[:MAX_INPUT_CHARS] + "...[truncated]" if cut else value
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def _loc(loc: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in ("body", *loc))


def media_type_error() -> ApiError:
    msg = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    return ApiError(msg, "Bad Request", 400, None)
