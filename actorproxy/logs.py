"""Logging set-up for ``actorproxy run``: plain text (default) or one JSON object per line.

The access log (``actorproxy.access``) passes its fields as ``extra={"fields":
{...}}``; the JSON format puts them at the top level of each line, the text
format has them in the message already. A record with an exception gets its
traceback (JSON: under ``"exc"``).

Every request writes an access line, so a line's cost counts: the record does not
look up its caller's file and line, thread and process (the logging HOWTO's
"Optimization" settings; no format here shows them), and both formats write the
time from a per-second cache (one ``strftime`` a second, not one a line).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

LogFormat = Literal["text", "json"]


class _Seconds:
    """``strftime`` of a whole second, redone only when the second changes."""

    __slots__ = ("convert", "pattern", "second", "text")

    def __init__(self, pattern: str, convert: Callable[[float], time.struct_time]) -> None:
        self.pattern, self.convert = pattern, convert
        self.second, self.text = -1, ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self.second:
            self.second, self.text = second, time.strftime(self.pattern, self.convert(second))
        return self.text


class TextFormatter(logging.Formatter):
    """``time level logger: message``, the time as ``logging.Formatter``'s default (local, ``,msecs``)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._seconds = _Seconds(self.default_time_format, time.localtime)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the access fields, the traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": f"{self._seconds(record.created)}.{int(record.msecs):03d}Z",
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
    # Records without their caller's file and line, thread and process: no format here shows them.
    logging._srcfile = None  # documented in the logging HOWTO ("Optimization")
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # httpx logs every request at INFO (health checks every few seconds); the access log is actorproxy.access.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
