"""A real S3 server on loopback (moto's), and an HTTP proxy before it that adds latency to every request.

What the object-storage tests and `bench_read.py --remote` run against: no network, no mock of the
client (s3fs speaks HTTP to a server).  The proxy forwards each request whole after `delay`
seconds, so a GET costs what a request to a bucket in another zone costs before its first byte.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(log) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free loopback port, once it accepts connections: (process, endpoint URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        time.sleep(self.server.delay)
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        up = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        up.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
        resp = up.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        up.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def log_message(self, *args) -> None:  # quiet
        pass


class LatencyProxy:
    """http://127.0.0.1:PORT forwarding to `upstream` (http://127.0.0.1:P), `delay` s per request."""

    def __init__(self, upstream: str, delay: float = 0.05):
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Forward)
        self.server.daemon_threads = True
        self.server.delay = delay
        self.server.upstream_port = int(upstream.rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
