"""Helpers to run a `blockdraft serve` process on loopback and talk to it (tests, load test)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10):
    """Ask a child process to exit with `sig`; kill it if it has not after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """`python -m blockdraft serve ARGS` on a free loopback port; waits for /health."""

    def __init__(self, *args: str, startup_timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blockdraft", "serve", "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + self.proc.stdout.read().decode(errors="replace"))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not come up in time")

    def stop(self, timeout: float = 60):
        end_process(self.proc, signal.SIGINT, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def stream_chat(
    url: str,
    messages: list[dict],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    api_key: str | None = None,
    model: str | None = None,
    timeout: float = 600,
) -> dict:
    """One streamed chat completion; returns text, finish reasons, [DONE] seen, usage and timings."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = {"text": "", "finish_reasons": [], "done": False, "usage": None, "status": None}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            r.read()
            out["error"] = r.text
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content") or ""
                if piece and "ttft" not in out:
                    out["ttft"] = time.perf_counter() - t0
                out["text"] += piece
                if c["finish_reason"]:
                    out["finish_reasons"].append(c["finish_reason"])
    out["latency"] = time.perf_counter() - t0
    return out
