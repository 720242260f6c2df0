"""Logging set-up for ``actorproxy run``: plain text (default) or one JSON object per line.

The access log (``actorproxy.access``) passes its fields as ``extra={"fields":
{...}}``; the JSON format puts them at the top level of each line, the text
format has them in the message already. A record with an exception gets its
traceback (JSON: under ``"exc"``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the access fields, the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    """Send every logger to stderr at ``level`` in ``log_format``; keep the chatty libraries quiet."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # httpx logs every request at INFO (health checks every few seconds); the access log is actorproxy.access.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
