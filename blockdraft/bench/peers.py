"""Peers: other programs' generation on the same weights, timed like ours in `blockdraft bench`.

  hf                  HF transformers' `generate` on the target folder
  hf-lookup[@B]       HF's prompt-lookup decoding (`prompt_lookup_num_tokens` = B - 1)
  llamacpp            llama.cpp (llama-cpp-python) on a GGUF of the same weights
  llamacpp-lookup[@B] llama.cpp with its prompt-lookup drafts (`num_pred_tokens` = B - 1)
  llamacpp-server     llama.cpp's llama-server, plain decoding (`bench/llama_server.py`)
  llamacpp-dflash[@B] llama-server's own DFlash with our drafter exported to GGUF, B - 1 drafts

Every peer gets the token ids we would decode (same chat template, same prompt) and stops
at the same end-of-turn tokens; its time covers the whole request, prefill included, as
`Engine.generate`'s does. llama.cpp's threads are set to torch's.

llama.cpp reads GGUF files. For the default target in fp32 the peers run the F32
de-quantization of its GGUF (exactly the fp32 weights blockdraft runs; written once, or by
`blockdraft export gguf`), and with `--dtype q4_1` the original Q4_1 file (the integers our
quantized path runs). `--gguf FILE` names another file (a GGUF of another target).
llama-cpp-python is an optional extra, compiled from source:
`pip install '.[peers]'`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..engine import Generation
from ..errors import BlockdraftError

LLAMACPP_HINT = (
    "llama.cpp peers need llama-cpp-python: pip install '.[peers]' "
    "(compiles llama.cpp from source, about 10 minutes on 2 cores)"
)


def llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_build() -> str:
    """What the installed llama.cpp build runs on this CPU (its system info: AVX2, AVX512, AMX ...)."""
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info()
        return (info.decode() if isinstance(info, bytes) else str(info)).strip()
    except Exception as exc:  # noqa: BLE001 - a report field, never a reason to fail
        return f"unknown ({type(exc).__name__})"


def q4_1_gguf(engine) -> Path:
    """The default target's original Q4_1 file (the `llamacpp-q4_1` peer)."""
    if not engine.default_target:
        raise BlockdraftError("llamacpp-q4_1 runs the default target's own Q4_1 file: use it without --target")
    from ..models.default import gguf_path

    return gguf_path()


def _finish(engine, ids: list[int], new: list[int], elapsed: float, method: str, block: int) -> Generation:
    eos = set(engine.stop_token_ids)
    for i, t in enumerate(new):
        if t in eos:
            new = new[: i + 1]
            break
    finish = "stop" if new and new[-1] in eos else "length"
    return Generation(
        text=engine.tokenizer.decode(new, skip_special_tokens=True),
        token_ids=new,
        num_prompt_tokens=len(ids),
        num_output_tokens=len(new),
        acceptance_lengths=[],
        tau=0.0,
        decode_seconds=elapsed,
        tokens_per_second=len(new) / elapsed if elapsed else 0.0,
        finish_reason=finish,
        method=method,
        block_size=block,
    )


class HFRunner:
    """HF transformers' own `generate` on the same weights (greedy, or sampled at T > 0)."""

    def __init__(self, engine):
        from transformers import AutoModelForCausalLM

        self.engine = engine
        self.model = AutoModelForCausalLM.from_pretrained(str(engine.target_name), dtype=engine.target.dtype)
        self.model = self.model.to(engine.target.device).eval()

    @torch.inference_mode()
    def generate(
        self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int, lookup_tokens: int = 0
    ) -> Generation:
        eos = list(self.engine.stop_token_ids)
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
            torch.manual_seed(seed)
        if lookup_tokens:
            kwargs["prompt_lookup_num_tokens"] = lookup_tokens
        inputs = torch.tensor([ids], device=self.engine.target.device)
        t0 = time.perf_counter()
        out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        elapsed = time.perf_counter() - t0
        return _finish(
            self.engine,
            ids,
            out[0, len(ids) :].tolist(),
            elapsed,
            "hf-lookup" if lookup_tokens else "hf",
            lookup_tokens + 1,
        )


def default_gguf(engine) -> Path:
    """The GGUF with the engine's own weights: for the default target in fp32 its F32 file
    (written once), with --dtype q4_1 the original Q4_1 file."""
    if not getattr(engine, "default_target", False):
        raise BlockdraftError(
            "llamacpp on a --target folder needs --gguf FILE (a GGUF of the same weights, "
            "e.g. from llama.cpp's convert_hf_to_gguf.py --outtype f32)"
        )
    from ..models.default import gguf_path
    from ..models.gguf import default_f32_gguf

    return gguf_path() if engine.weights == "q4_1" else default_f32_gguf()


def probe_llamacpp(path: Path) -> None:
    """Generate one token from `path` in a child process: a llama.cpp build that crashes on
    this machine (e.g. AMX kernels where AMX is not enabled, SIGILL) fails here with a clear
    error instead of killing the benchmark."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys; from llama_cpp import Llama; "
        "m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False); "
        "next(m.generate([1, 2, 3], temp=0.0, top_k=1))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    if proc.returncode == -signal.SIGILL:
        from .llama_server import AMX_HINT

        raise BlockdraftError(AMX_HINT.format(what=f"llama.cpp on {path.name}", target="peers"))
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BlockdraftError(f"llama.cpp cannot run {path.name}: {tail}")


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, one model instance per number of lookup drafts."""

    def __init__(self, engine, gguf: str | Path | None = None, context: int = 4096):
        if not llamacpp_available():
            raise BlockdraftError(LLAMACPP_HINT)
        self.engine = engine
        self.path = Path(gguf) if gguf else default_gguf(engine)
        if not self.path.is_file():
            raise BlockdraftError(f"GGUF file not found: {self.path}")
        probe_llamacpp(self.path)
        self.context = context
        self._models = {}

    @staticmethod
    def describe(engine, gguf: str | Path | None) -> str:
        """'NAME (F32)': the file the llamacpp peers ran, for reports."""
        from ..models.gguf import gguf_tensor_type

        path = Path(gguf) if gguf else default_gguf(engine)
        return f"{path.name} ({gguf_tensor_type(path)})"

    def model(self, lookup_tokens: int):
        llm = self._models.get(lookup_tokens)
        if llm is None:
            from llama_cpp import Llama

            kwargs = {}
            if lookup_tokens:
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
            threads = torch.get_num_threads()
            llm = self._models[lookup_tokens] = Llama(
                model_path=str(self.path),
                n_ctx=self.context,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
                **kwargs,
            )
        return llm

    def generate(
        self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int, lookup_tokens: int = 0
    ) -> Generation:
        if len(ids) + max_new_tokens > self.context:
            raise BlockdraftError(
                f"llamacpp: prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"its context of {self.context} tokens"
            )
        llm = self.model(lookup_tokens)
        eos = set(self.engine.stop_token_ids)
        sampling = dict(temp=0.0, top_k=1) if temperature <= 0 else dict(temp=temperature, top_k=0)
        llm.reset()  # no prefix reuse between requests: the prompt is prefilled every time, as ours is
        if temperature > 0:
            llm.set_seed(seed)
        new = []
        t0 = time.perf_counter()
        for token in llm.generate(ids, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True, **sampling):
            new.append(token)
            if token in eos or len(new) >= max_new_tokens:
                break
        elapsed = time.perf_counter() - t0
        return _finish(
            self.engine, ids, new, elapsed, "llamacpp-lookup" if lookup_tokens else "llamacpp", lookup_tokens + 1
        )


SERVER_PEERS = ("llamacpp-server", "llamacpp-server-q4_1", "llamacpp-dflash")


class LlamaServerRunner:
    """llama-server peers: one server per drafter setting, started on first use, stopped at exit."""

    def __init__(self, engine, gguf: str | Path | None = None, draft_type: str = "F16", full_vocab: bool = False):
        from .llama_server import BUILD_HINT, find_llama_server

        if find_llama_server() is None:
            raise BlockdraftError(BUILD_HINT)
        self.engine = engine
        self.path = Path(gguf) if gguf else default_gguf(engine)
        if not self.path.is_file():
            raise BlockdraftError(f"GGUF file not found: {self.path}")
        self.draft_type, self.full_vocab = draft_type, full_vocab
        self._servers = {}

    def server(self, draft_max: int):
        from .llama_server import LlamaServer, drafter_gguf

        srv = self._servers.get(draft_max)
        if srv is None:
            drafter = None
            if draft_max:
                drafter = drafter_gguf(
                    self.engine.drafter_for("dflash").folder, self.path, self.draft_type, self.full_vocab
                )
            srv = self._servers[draft_max] = LlamaServer(self.path, drafter=drafter, draft_max=draft_max or None)
        return srv

    def generate(
        self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int, draft_max: int = 0
    ) -> Generation:
        new, lengths, timings, seconds = self.server(draft_max).complete(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
        )
        out = _finish(
            self.engine, ids, new, seconds, "llamacpp-dflash" if draft_max else "llamacpp-server", draft_max + 1
        )
        if draft_max:
            out.acceptance_lengths = lengths
            out.tau = sum(lengths) / len(lengths) if lengths else 0.0
            out.steps = len(lengths)
        out.prefill_seconds = (timings.get("prompt_ms") or 0.0) / 1000
        return out

    def close(self):
        for srv in self._servers.values():
            srv.close()
        self._servers.clear()


class Peers:
    """The peer runners a benchmark needs, made on first use."""

    def __init__(self, engine, gguf: str | Path | None = None, llamacpp_draft: tuple[str, bool] = ("F16", False)):
        self.engine, self.gguf = engine, gguf
        self.llamacpp_draft = llamacpp_draft  # llamacpp-dflash: (drafter GGUF weight type, full vocabulary)
        self._hf = self._llamacpp = self._llamacpp_q4 = None
        self._servers: dict[str, LlamaServerRunner] = {}  # per GGUF file

    def check(self, kinds):
        """Fail early (before any generation) when a peer cannot run here."""
        from .llama_server import BUILD_HINT, find_llama_server

        if any(k in SERVER_PEERS for k in kinds) and find_llama_server() is None:
            raise BlockdraftError(BUILD_HINT)
        if any(k.startswith("llamacpp") and k not in SERVER_PEERS for k in kinds) and not llamacpp_available():
            raise BlockdraftError(LLAMACPP_HINT)

    def close(self):
        for runner in self._servers.values():
            runner.close()

    def generate(self, kind: str, block: int, ids: list[int], **kwargs) -> Generation:
        lookup = block - 1 if kind.endswith("-lookup") else 0
        if kind in SERVER_PEERS:
            gguf = q4_1_gguf(self.engine) if kind == "llamacpp-server-q4_1" else self.gguf
            runner = self._servers.get(str(gguf))
            if runner is None:
                runner = self._servers[str(gguf)] = LlamaServerRunner(self.engine, gguf, *self.llamacpp_draft)
            return runner.generate(ids, draft_max=block - 1 if kind == "llamacpp-dflash" else 0, **kwargs)
        if kind == "llamacpp-q4_1":
            if self._llamacpp_q4 is None:
                self._llamacpp_q4 = LlamaCppRunner(self.engine, q4_1_gguf(self.engine))
            return self._llamacpp_q4.generate(ids, **kwargs)
        if kind.startswith("llamacpp"):
            if self._llamacpp is None:
                self._llamacpp = LlamaCppRunner(self.engine, self.gguf)
            return self._llamacpp.generate(ids, lookup_tokens=lookup, **kwargs)
        if self._hf is None:
            self._hf = HFRunner(self.engine)
        return self._hf.generate(ids, lookup_tokens=lookup, **kwargs)
