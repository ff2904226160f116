"""Log lines as text or as JSON (one object per line, for log pipelines)."""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_handler: logging.Handler | None = None  # the one `configure` installed, if any


def configure(level: str, fmt: str = "text") -> None:
    """Like logging.basicConfig: a process that already logs somewhere (an embedding
    program, a test runner) keeps its handlers; only the level changes."""
    global _handler
    root = logging.getLogger()
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
    if not root.handlers:
        _handler = logging.StreamHandler()
        root.addHandler(_handler)
        use_format(fmt)
    # one line per upstream call at INFO drowns the router's own messages
    logging.getLogger("httpx").setLevel(logging.WARNING)


def use_format(fmt: str) -> None:
    """Set the line format of the handler `configure` installed (a config file read after
    logging started may name another)."""
    if _handler is None:
        return
    if fmt == "json":
        _handler.setFormatter(JsonFormatter())
    else:
        _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
