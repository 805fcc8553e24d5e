"""Programs whose state lives only in a process's memory, for checking checkpoints and restores.

A restored file proves little; a counter that only a running process holds proves that the processes
came back too. Tests (`tests/sandbox`) and benchmarks (`belayer bench env-recovery`) share these.

Example::

    backend.write_file(box.id, "server.py", PYTHON_COUNTER_SERVER.encode())
    backend.exec(box.id, "python3 server.py >/dev/null 2>&1 &")
    backend.exec(box.id, PYTHON_COUNTER_QUERY).stdout   # "1\\n", then "2\\n", ...
"""

from __future__ import annotations

PYTHON_COUNTER_PORT = 8765

PYTHON_COUNTER_SERVER = f"""
import http.server
hits = {{"n": 0}}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        hits["n"] += 1
        body = str(hits["n"]).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", {PYTHON_COUNTER_PORT}), H).serve_forever()
"""
"""A Python HTTP server (stdlib only) on 127.0.0.1:8765 whose hit count is in memory only."""

PYTHON_COUNTER_QUERY = (
    "python3 -c 'import urllib.request as u; "
    f'print(u.urlopen("http://127.0.0.1:{PYTHON_COUNTER_PORT}/", timeout=5).read().decode())\''
)
"""A command that counts one hit and prints the server's count."""

SHELL_COUNTER_SERVER = (
    'sh -c \'n=0; trap "n=\\$((n+1)); echo \\$n > /workspace/count" USR1; '
    "while :; do sleep 0.2 & wait $!; done' >/dev/null 2>&1 &\n"
    "echo $! > /workspace/server.pid"
)
"""A shell "server" (busybox is enough): each SIGUSR1 bumps its n and writes it to /workspace/count;
its PID is in /workspace/server.pid."""
