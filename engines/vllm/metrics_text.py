"""The few samples the router reads from a vLLM `/metrics` page, without parsing the rest.

A vLLM 0.32 page is ~1,000 lines, nearly all histogram buckets the router never reads, and
prometheus_client's parser builds every family: ~10 ms per page, on the event loop, per
worker per scrape (a request that arrives meanwhile waits that long). This reads only the
lines whose metric name is wanted and parses just those: ~0.3 ms for the same page. Every
wanted line must parse exactly (the Prometheus text format: name, optional labels with
escaped values, value, optional timestamp); where one does not, the caller falls back to
prometheus_client's parser for the whole page, so an unusual page costs time, never data.
`tests/test_metrics_text.py` holds it equal to prometheus_client on random pages, and the
conformance suite on the real engine's page.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator

Sample = tuple[str, dict[str, str], float]

_LINE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>[^\"}]*(?:\"(?:[^\"\\]|\\.)*\"[^\"}]*)*)\})?"
    r"[ \t]+(?P<value>[^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*"
)
_LABEL = re.compile(r"[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*\"((?:[^\"\\]|\\.)*)\"[ \t]*,?")
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE = re.compile(r"\\[\\\"n]")


class Unparsed(ValueError):
    """A wanted line that this reader does not parse exactly: use the full parser."""


def wanted_samples(text: str, names: Collection[str], prefix: str = "vllm:") -> Iterator[Sample]:
    """(name, labels, value) of every sample line whose metric name is in `names` (all of
    which start with `prefix`), in page order."""
    for line in text.split("\n"):
        if not line.startswith(prefix):
            continue
        cut = line.find("{")
        head = line[:cut] if cut >= 0 else line.split(" ", 1)[0].split("\t", 1)[0]
        if head not in names:
            continue
        m = _LINE.fullmatch(line.rstrip("\r"))
        if m is None:
            raise Unparsed(f"metrics line not understood: {line[:120]!r}")
        try:
            value = float(m["value"])
        except ValueError:
            raise Unparsed(f"metrics value not a number: {line[:120]!r}") from None
        yield m["name"], _labels(m["labels"] or "", line), value


def _labels(raw: str, line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(raw):
        m = _LABEL.match(raw, pos)
        if m is None or m.end() == pos:
            if raw[pos:].strip(" \t") == "":
                break
            raise Unparsed(f"metrics labels not understood: {line[:120]!r}")
        value = m[2]
        out[m[1]] = _ESCAPE.sub(lambda e: _ESCAPES[e[0]], value) if "\\" in value else value
        pos = m.end()
    return out
