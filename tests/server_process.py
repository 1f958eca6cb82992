"""Starts `pagedrs serve` as a real process on a free loopback port, and small raw-HTTP
helpers for the server tests (the official `openai` client covers the rest)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None
    ) -> tuple[int, Any]:
        """``(status, parsed JSON or text)``."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        connection.request(method, path, body=payload, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        data = response.read().decode()
        connection.close()
        try:
            return response.status, json.loads(data)
        except json.JSONDecodeError:
            return response.status, data

    def metrics(self) -> dict[str, float]:
        """The unlabelled value of every ``pagedrs:`` sample (summed over labels)."""
        status, text = self.request("GET", "/metrics")
        assert status == 200
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pagedrs:"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_server(args: list[str], log_path: str, env: dict[str, str] | None = None, timeout: float = 240) -> Server:
    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedrs.server", *args, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    server = Server(process, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()[-3000:]}")
        try:
            if server.request("GET", "/health")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"the server did not come up in {timeout} s:\n{server.log()[-3000:]}")


def wait_for(condition, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
