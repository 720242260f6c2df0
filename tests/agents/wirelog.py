"""A recording HTTP forwarder: what a real client sent, for the test's wire log.

The agent CLIs talk to this forwarder, which relays every request to the proxy
unchanged and streams the answer back as it arrives (SSE included). Each
exchange is appended to a JSON-lines file: method, path, headers, the request
body (parsed when JSON), the status and, for errors, the answer. A failing test
shows the file, so the request that broke is on screen.

Threads are fine here: this is test scaffolding around real subprocesses, not
the proxy's code.
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

#: Request bodies are logged up to this many characters per string value.
MAX_STRING = 2000
#: Hop-by-hop headers the forwarder manages itself.
_SECRET = {"authorization", "x-api-key"}
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class _Interim:
    """The socket's reader, handed to the response after an interim one (``http.client`` reads one response per
    request, and takes a ``102 Processing`` for the answer)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def makefile(self, mode: str) -> Any:
        return self.reader


def _final(answer: http.client.HTTPResponse, method: str, interim: Any) -> http.client.HTTPResponse:
    """The final response after any interim ones (``1xx``), each passed to ``interim(status, reason)``."""
    while 100 <= answer.status < 200:
        interim(answer.status, answer.reason)
        reader, answer.fp = answer.fp, None  # (a response closes its reader when it is collected)
        answer = http.client.HTTPResponse(_Interim(reader), method=method)  # type: ignore[arg-type]
        answer.begin()
    return answer


def _shorten(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_STRING:
        return value[:MAX_STRING] + f"... [{len(value)} chars]"
    if isinstance(value, list):
        return [_shorten(v) for v in value]
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    return value


class WireLog:
    """Forward ``127.0.0.1:<port>`` to ``upstream_port``, logging each exchange to ``path``."""

    def __init__(self, upstream_port: int, path: Path) -> None:
        self.path = path
        self.entries: list[dict[str, Any]] = []
        lock = threading.Lock()
        log = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                entry: dict[str, Any] = {
                    "method": self.command,
                    "path": self.path,
                    "headers": {k: v for k, v in self.headers.items() if k.lower() not in _SECRET},
                }
                try:
                    entry["body"] = _shorten(json.loads(body)) if body else None
                except ValueError:
                    entry["body"] = body[:MAX_STRING].decode("utf-8", "replace")
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)

                    def interim(status: int, reason: str) -> None:  # passed on, as the proxy sent it
                        self.wfile.write(f"HTTP/1.1 {status} {reason}\r\n\r\n".encode())
                        self.wfile.flush()
                        entry.setdefault("interim", []).append(status)

                    answer = _final(upstream.getresponse(), self.command, interim)
                    entry["status"] = answer.status
                    self.send_response(answer.status)
                    for key, value in answer.getheaders():
                        if key.lower() not in _HOP:
                            self.send_header(key, value)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    sent = bytearray()
                    while chunk := answer.read1(65536):
                        if answer.status >= 400 or len(sent) < 4096:
                            sent += chunk[: 4096 - len(sent)] if answer.status < 400 else chunk
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    entry["answer_head"] = sent.decode("utf-8", "replace")
                except OSError as exc:
                    entry["error"] = repr(exc)
                    raise
                finally:
                    upstream.close()
                    with lock:
                        log.entries.append(entry)
                        with log.path.open("a") as out:
                            out.write(json.dumps(entry, ensure_ascii=False) + "\n")

            do_GET = do_POST = do_PUT = do_DELETE = _relay  # noqa: N815 - http.server's naming

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WireLog:
        self.path.write_text("")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def summary(self) -> str:
        """One line per exchange, for a failure message (the file has the bodies)."""
        lines = [f"wire log: {self.path}"]
        for e in self.entries:
            line = f"  {e['method']} {e['path']} -> {e.get('status', e.get('error'))}"
            if e.get("status", 200) >= 400:
                line += f"  {e.get('answer_head', '')[:500]}"
            lines.append(line)
        return "\n".join(lines)
