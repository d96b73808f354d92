"""llama.cpp's own `llama-server`, with and without its DFlash, as a benchmark peer.

  llamacpp-server      plain decoding in llama-server on the target's GGUF
  llamacpp-dflash[@B]  llama-server's DFlash (`--spec-type draft-dflash`; draft-dspark for a drafter
                       with a Markov head) with our drafter, exported to GGUF (`blockdraft export
                       gguf-drafter`), B - 1 drafts per step (default: the drafter's trained block)

`make llama-server` (or `make peers`) builds the binary once from the llama.cpp source that
the pinned llama-cpp-python sdist vendors; `$BLOCKDRAFT_LLAMA_SERVER` or a `llama-server` on
the PATH is used otherwise. One server runs per configuration (started on first use, on a
free loopback port, `--parallel 1`, llama.cpp threads = torch's), every request answered
from scratch (`cache_prompt` off: the prompt is prefilled every time, as ours is); the time
of a request is the client's wall time around it, prefill included, as `Engine.generate`'s.

Acceptance: llama-server with `LLAMA_TRACE=1` logs each verify step ("accepted A/N draft
tokens"); a step's acceptance length is A + 1 (the bonus token), as in our loop. The log's
total is checked against the response's `draft_n_accepted`.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import torch

from ..errors import BlockdraftError
from ..serve.client import end_process, free_port

REPO_BUILD = Path(__file__).resolve().parents[2] / "build" / "llama.cpp" / "bin" / "llama-server"
BUILD_HINT = (
    "llama.cpp's llama-server is not built: `make llama-server` builds it once from the pinned "
    "llama-cpp-python sdist's source (~17 minutes on 2 cores), or set BLOCKDRAFT_LLAMA_SERVER to a binary"
)
AMX_HINT = (
    "{what} died with an illegal instruction: it was compiled for AMX, which this CPU reports but its "
    "kernel or hypervisor does not enable (quantized weights run AMX kernels). Rebuild without AMX: "
    "rm -rf build/llama.cpp && make {target} LLAMACPP_CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON "
    "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON'"
)
STEP = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")


def find_llama_server() -> Path | None:
    env = os.environ.get("BLOCKDRAFT_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else None
    if REPO_BUILD.is_file():
        return REPO_BUILD
    found = shutil.which("llama-server")
    return Path(found) if found else None


class LlamaServer:
    """One llama-server process (optionally with a DFlash drafter); `complete(ids, ...)`
    returns (new token ids, per-step acceptance lengths, response timings)."""

    def __init__(
        self,
        model: str | Path,
        *,
        drafter: str | Path | None = None,
        draft_max: int | None = None,
        context: int = 4096,
        threads: int | None = None,
        binary: str | Path | None = None,
        start_timeout: float = 300.0,
        extra_args: tuple[str, ...] = (),
    ):
        binary = Path(binary) if binary else find_llama_server()
        if binary is None:
            raise BlockdraftError(BUILD_HINT)
        threads = threads or torch.get_num_threads()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-c",
            str(context),
            "-np",
            "1",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--no-webui",
            "-ngl",
            "0",
        ]
        if drafter is not None:
            cmd += [
                "--spec-type",
                spec_type(drafter),
                "--spec-draft-model",
                str(drafter),
                "--spec-draft-ngl",
                "0",
                "--spec-draft-p-min",
                "0",
                "-td",
                str(threads),
                "-tbd",
                str(threads),
            ]
            if draft_max is not None:
                cmd += ["--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"]
        cmd += list(extra_args)
        self.cmd = cmd
        self.log: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "LLAMA_TRACE": "1"}
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=5.0))
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                if self.proc.returncode == -signal.SIGILL:
                    raise BlockdraftError(AMX_HINT.format(what="llama-server", target="llama-server"))
                tail = "\n".join(self.log[-15:])
                raise BlockdraftError(f"llama-server exited with {self.proc.returncode} while starting:\n{tail}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise BlockdraftError(f"llama-server did not become healthy in {start_timeout:.0f} s")
            time.sleep(0.2)

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))
            self._lines.put(line)

    def _drain(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._lines.get_nowait())
            except queue.Empty:
                return out

    def complete(
        self, ids: list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[list[int], list[int], dict, float]:
        """Generate from prompt token ids: (new ids, acceptance lengths per verify step,
        llama-server's timings, client seconds)."""
        self._drain()
        body = {
            "prompt": list(ids),
            "n_predict": max_new_tokens,
            "cache_prompt": False,
            "return_tokens": True,
            "seed": seed,
            "temperature": temperature,
            "top_k": 0 if temperature > 0 else 1,
            "top_p": 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "stream": False,
        }
        t0 = time.perf_counter()
        reply = self.http.post("/completion", json=body)
        seconds = time.perf_counter() - t0
        if reply.status_code != 200:
            raise BlockdraftError(f"llama-server answered {reply.status_code}: {reply.text[:300]}")
        data = reply.json()
        timings = data.get("timings") or {}
        lengths: list[int] = []
        want = timings.get("draft_n_accepted")
        deadline = time.monotonic() + 5.0
        while True:  # the step lines may trail the response by a moment
            lengths += [int(m.group(1)) + 1 for line in self._drain() for m in [STEP.search(line)] if m]
            if want is None or sum(a - 1 for a in lengths) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return list(data.get("tokens") or []), lengths, timings, seconds

    def close(self):
        self.http.close()
        end_process(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def spec_type(drafter: str | Path) -> str:
    """llama-server's speculative type for a drafter GGUF: draft-dspark where it holds a Markov
    head (`markov_w1`), draft-dflash otherwise (llama.cpp's own rule when it detects the type)."""
    from gguf import GGUFReader

    return "draft-dspark" if any(t.name == "markov_w1.weight" for t in GGUFReader(drafter).tensors) else "draft-dflash"


def drafter_gguf(
    drafter: str | Path, target_gguf: str | Path, weight_type: str = "F16", full_vocab: bool = False
) -> Path:
    """Our drafter as llama.cpp's drafter GGUF, written once into a cache folder keyed by the
    drafter's weights, the target file, the weight type and the vocabulary choice."""
    import hashlib

    from ..export_gguf import export_gguf_drafter
    from ..models.default import cache_home

    drafter, target_gguf = Path(drafter), Path(target_gguf)
    h = hashlib.sha256()
    for f in sorted(drafter.glob("*.json")) + sorted(drafter.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"{target_gguf.resolve()}:{weight_type}:{full_vocab}".encode())
    vocab = ".full-vocab" if full_vocab else ""
    out = cache_home() / "gguf-drafters" / f"{drafter.name}-{h.hexdigest()[:12]}.{weight_type}{vocab}.gguf"
    if not out.is_file():
        export_gguf_drafter(drafter, out, target_gguf, weight_type, full_vocab)
    return out


def describe(path: str | Path) -> dict:
    """The binary, its version line and the CPU features it was built for (its "system_info"
    line, which it logs at debug verbosity before loading a model: here a missing one), for reports."""

    def run(*args):
        try:
            out = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=30)
            return (out.stdout + out.stderr).strip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            return []

    info = next(
        (
            line.split("system_info:", 1)[1]
            for line in run("-lv", "4", "-m", "/nonexistent.gguf", "--port", "0")
            if "system_info:" in line
        ),
        "",
    )
    return {
        "binary": str(path),
        "version": next((v for v in run("--version") if "version" in v), ""),
        "build": info.split("|", 1)[-1].strip() if info else "not recorded",
    }
