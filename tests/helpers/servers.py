"""Starts `pagedrs serve` as a real process on a free loopback port (or the same app in this
process, to reach into its engine), and small raw-HTTP helpers for the server tests (the
official `openai` client covers the rest)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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

    def stream_chat(self, model: str, messages: list[dict[str, str]], max_tokens: int) -> str:
        """A greedy chat completion streamed through the official `openai` client; its text."""
        import openai

        client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

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


class InProcessServer:
    """The real app under uvicorn on a thread, so a test can reach into its engine."""

    def __init__(self, argv: list[str]):
        import uvicorn

        from pagedrs.server.launch import add_serve_arguments, build_server

        args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
        self.app, self.engine = build_server(args)
        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.uvicorn.started, timeout=30)
        self.http = Server(process=None, port=self.port, log_path="")

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


def engine_idle(server: InProcessServer) -> bool:
    """No request left in the server's engine and no KV block held: what every bad input must
    leave behind."""
    engine = server.engine.engine
    return engine.scheduler.stats().num_used_blocks == 0 and not engine.has_unfinished_requests()


def send_raw(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    chunked: bool = False,
    timeout: float = 120,
) -> tuple[int, Any]:
    """``(status, parsed JSON or text)`` for exactly these bytes, on a fresh connection.

    Unlike `Server.request`, the body may be anything (invalid UTF-8, a wrong content type,
    chunked, a Content-Length header that lies), and a server that answers before it has read
    the whole body (a 413) is heard: a failed send is ignored and the answer read all the same."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
        chunk_bytes = 65536
        payload = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + chunk_bytes]), body[i : i + chunk_bytes])
            for i in range(0, len(body), chunk_bytes)
        )
        payload += b"0\r\n\r\n"
    else:
        headers.setdefault("Content-Length", str(len(body)))
        payload = body
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(head.encode("latin-1") + payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (and closed) before the body was read: the answer is still there
        response = http.client.HTTPResponse(sock, method=method)
        try:
            response.begin()
            data = response.read()
        except (ConnectionResetError, http.client.RemoteDisconnected) as error:
            raise AssertionError(f"{method} {path}: the server closed the connection without an answer") from error
        except TimeoutError as error:
            raise AssertionError(f"{method} {path}: no answer in {timeout} s") from error
    text = data.decode(errors="replace")
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


STREAMING_CLIENT = r"""
import json, socket, sys, time

port, count, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
connections = []
for index in range(count):
    payload = json.dumps(
        {"prompt": f"w{5 + index} w6", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    ).encode()
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
    )
    connections.append(connection)
for connection in connections:
    received = b""
    while b"data: " not in received and (chunk := connection.recv(4096)):
        received += chunk
print("streaming", flush=True)
time.sleep(600)
"""
"""A client process (``python -c STREAMING_CLIENT PORT COUNT MAX_TOKENS``) that opens COUNT
streams, prints ``streaming`` once each has sent its first event, then waits to be killed."""


async def stream_and_leave(
    port: int, path: str, body: dict[str, Any], behaviour: str, num_events: int = 2, reset: bool = False
) -> bytes:
    """Opens a stream and leaves as ``behaviour`` says: ``mid-body`` (half the body sent),
    ``before-first-byte``, ``mid-stream`` (after ``num_events`` events) or ``to-the-end``;
    with ``reset``, by a TCP reset instead of a clean close. Returns the bytes received."""
    import asyncio
    import contextlib
    import struct

    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        writer.write(head + (payload[: len(payload) // 2] if behaviour == "mid-body" else payload))
        await writer.drain()
        if behaviour == "mid-stream":
            while received.count(b"data: ") < num_events and (chunk := await reader.read(4096)):
                received += chunk
        elif behaviour == "to-the-end":
            received = await reader.read()
    finally:
        if reset:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    return received


STREAM_BODY = {"prompt": "w5 w6 w7", "ignore_eos": True, "temperature": 0}
"""What `stream` completes: words the default model and the tiny checkpoints both tokenize."""


def stream(port: int, max_tokens: int, started: threading.Event | None = None) -> dict[str, Any]:
    """One streamed completion over raw HTTP: its status, text chunks, finish reason, error
    events and whether ``[DONE]`` came."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({**STREAM_BODY, "max_tokens": max_tokens, "stream": True})
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    result: dict[str, Any] = {"status": response.status, "chunks": 0, "finish": None, "errors": [], "done": False}
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            result["done"] = True
            continue
        event = json.loads(data)
        if "error" in event:
            result["errors"].append(event["error"])
            continue
        for choice in event["choices"]:
            result["chunks"] += bool(choice["text"])
            result["finish"] = choice["finish_reason"] or result["finish"]
        if started is not None:
            started.set()
    connection.close()
    return result


def start_streams(port: int, count: int, max_tokens: int):
    """``count`` streams on threads; returns their futures once each has had its first token."""
    pool = ThreadPoolExecutor(count)
    started = [threading.Event() for _ in range(count)]
    futures = [pool.submit(stream, port, max_tokens, event) for event in started]
    assert all(event.wait(120) for event in started)
    return pool, futures


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        return []


def command_line(pid: int) -> str:
    """A process's command line, its arguments separated by NUL ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    """Whether a process runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
