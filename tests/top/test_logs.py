"""Log lines (actorproxy/logs.py): the time from a per-second cache, exactly as logging would write it."""

from __future__ import annotations

import json
import logging
import time

from actorproxy.logs import JsonFormatter, TextFormatter


def _record(created: float) -> logging.LogRecord:
    record = logging.LogRecord("actorproxy.access", logging.INFO, "f.py", 1, "method=POST status=200", None, None)
    record.created, record.msecs = created, int((created - int(created)) * 1000)
    return record


def test_the_time_of_each_line_is_what_logging_itself_writes_within_a_second_and_across_seconds() -> None:
    stdlib = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    ours, as_json = TextFormatter(), JsonFormatter()
    start = float(int(time.time()))
    for created in (start + 0.123, start + 0.987, start + 1.001, start + 1.5, start + 3600.25, start + 0.5):
        record = _record(created)
        assert ours.format(record) == stdlib.format(record)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{record.msecs:03d}Z"
        assert json.loads(as_json.format(record))["ts"] == stamp
