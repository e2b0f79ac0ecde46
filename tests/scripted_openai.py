"""A scripted OpenAI-compatible server on loopback, for the remote bench's tests of what a real server rarely does
on cue (fail some requests, stream without usage, pace its chunks): real HTTP, real SSE, a test's own answers."""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedServer(BaseHTTPRequestHandler):
    """/v1/models, /version and /tokenize answered; a subclass streams /v1/completions (do_POST's rest)."""

    def do_GET(self):
        self.json_reply(200, {"data": [{"id": "m", "object": "model"}]} if self.path == "/v1/models" else {"version": "9"})

    def tokenized(self) -> dict | None:
        """The request's body; None where it was /tokenize, answered already."""
        size = int(self.headers["content-length"])
        data = self.rfile.read(size)
        if len(data) < size:  # the client left before its body arrived (a run stopped early): no request to answer
            raise ConnectionAbortedError(f"body cut at {len(data)} of {size} bytes")
        body = json.loads(data)
        if self.path != "/tokenize":
            return body
        self.json_reply(200, {"tokens": list(range(50))})
        return None

    def event(self, chunk: dict):
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()

    def json_reply(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class QuietServer(ThreadingHTTPServer):
    """A client that left mid-reply (a run stopped early, a stream broken off) is what these tests script: its
    ConnectionError, wherever the handler meets it (handle or the last flush in finish), is no trace on stderr."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Servers:
    """Starts scripted servers and stops them all at close (a fixture's teardown)."""

    def __init__(self):
        self.running: list[ThreadingHTTPServer] = []

    def start(self, handler: type, queue_size: int = 5) -> str:
        httpd = type("Httpd", (QuietServer,), {"request_queue_size": queue_size})(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        self.running.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    def close(self):
        for httpd in self.running:
            httpd.shutdown()
            httpd.server_close()
