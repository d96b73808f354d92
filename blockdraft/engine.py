"""The Python API: load a target (and a drafter) once, then generate or stream.

    from blockdraft import Engine
    engine = Engine.load()                       # default target + shipped drafter
    out = engine.generate("Write a haiku about rain.", chat=True, max_new_tokens=64)
    print(out.text, out.tau)
    for piece in engine.stream("Tell me a joke.", chat=True):
        print(piece, end="", flush=True)

The CLI, the benchmark and the server all go through this class.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Callable, Iterator

import torch

from . import drafters
from .batcher import generate_steps
from .draft import DFlashDrafter
from .errors import BlockdraftError
from .models import Transformer, load_target, load_tokenizer, stop_token_ids
from .models.default import DEFAULT_TARGET_NAME, default_target_dir
from .models.exact import make_exact
from .precision import auto_dtype, explain
from .models.packed import pack_linears, packing_available
from .proposers import Proposer
from .sampling import SamplingParams
from .sequences import Request, SequenceState
from .spec import SpecConfig

if TYPE_CHECKING:
    from .grammar import Grammar, GrammarSpec
from .text import TextStream, chat_prompt_ids

# Drafters shipped inside the package (package data), by (target name, drafter kind).
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
SHIPPED_DRAFTS = {
    (DEFAULT_TARGET_NAME, "dflash"): SHIPPED_DIR / "smollm2-135m-instruct-dflash",
    (DEFAULT_TARGET_NAME, "eagle3"): SHIPPED_DIR / "smollm2-135m-instruct-eagle3",
}


def shipped_drafter(kind: str, target_name: str = DEFAULT_TARGET_NAME) -> Path | None:
    """The folder of the drafter of this kind shipped for a target, if there is one."""
    folder = SHIPPED_DRAFTS.get((target_name, kind))
    return folder if folder is not None and (folder / "config.json").is_file() else None


@dataclass
class Generation:
    """The result for one prompt."""

    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    acceptance_lengths: list[int]
    tau: float
    decode_seconds: float
    tokens_per_second: float
    finish_reason: str
    method: str
    block_size: int
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    grammar_seconds: float = 0.0  # of those, structured output's (masks, draft constraints)
    steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Row:
    """A request with its stop strings and its incremental text (what the server keeps per request)."""

    request: Request
    stream: TextStream
    stops: list[str] = field(default_factory=list)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_draft_weights(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """`Engine.load`'s draft_weights ("auto" | "float" | "int8" | "bf16") -> "float", "int8" or
    "bf16" (for an fp32 target: DFlash drafters in bf16 through the native pass, `draft_native`;
    a bf16 target's drafters are "float" already). "auto": "bf16" for an fp32 target on a CPU
    where the native kernels run, else int8 where torch's kernel has it (fp32 on CPU), else float."""
    from .models import native
    from .models.quant import DRAFT_WEIGHTS, int4_available, without_bf16

    if choice not in DRAFT_WEIGHTS:
        raise BlockdraftError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {choice!r}")
    native_bf16 = device.type == "cpu" and dtype == torch.float32 and native.available()
    if choice == "auto":
        return "bf16" if native_bf16 else without_bf16(device, dtype)
    if choice == "int8" and (device.type != "cpu" or not int4_available()):
        raise BlockdraftError(
            "int8 drafter weights run on CPU with torch's int8 kernel (torch >= 2.6); use --draft-weights float here"
        )
    if choice == "bf16" and dtype == torch.bfloat16 and device.type == "cpu":
        return "float"
    if choice == "bf16" and not native_bf16:
        raise BlockdraftError(
            "bf16 drafter weights run for a float32 target on a CPU with AVX512-BF16 through blockdraft's native "
            "kernels (a C++ compiler and ninja); use --draft-weights float or int8 here"
        )
    return choice


class Engine:
    def __init__(
        self,
        target: Transformer,
        tokenizer,
        drafter: DFlashDrafter | None = None,
        target_name: str = "",
        draft_note: str | None = None,
        eagle=None,
        default_target: bool = False,
        packed: bool = False,
        draft_weights: str = "float",
    ):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self._grammar_lock = threading.Lock()
        self._grammars: dict = {}  # compiled grammars by spec, newest last (`grammar`)
        self.draft_weights = draft_weights  # "float" or "int8": what drafters loaded later are turned into
        self.eagle = eagle  # an EAGLE-3-style baseline drafter, for comparisons
        self.default_target = default_target  # shipped drafters apply (loaded on first use)
        self.packed = packed
        quantization = getattr(target, "quantization", None)
        # which weights run: "float32", "bfloat16", ... or a quantized format ("q4_1")
        self.weights = quantization["format"] if quantization else str(target.dtype).removeprefix("torch.")
        if eagle is not None:
            eagle.check_target(target.config)
        self.target_name = target_name
        self.dtype_reason = "chosen"  # why the target runs in its dtype (`Engine.load`: measured for auto)
        self.draft_note = draft_note  # why there is no drafter, when there is none
        if drafter is not None:
            drafter.check_target(target.config)
        self.stop_token_ids = stop_token_ids(target_name, tokenizer)

    @classmethod
    def load(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        device=None,
        dtype: torch.dtype | str | None = None,
        use_draft: bool = True,
        eagle: str | Path | None = None,
        packed: bool = True,
        draft_weights: str = "auto",
        exact: bool = True,
    ) -> Engine:
        """Load a target folder (default: SmolLM2-135M-Instruct) and a drafter folder
        (default: the one shipped for that target, if any). `use_draft=False` skips it.
        `eagle` names an EAGLE-3-style drafter folder (method "eagle3"; default: the shipped one,
        loaded on first use).
        `packed` (fp32 on CPU, with `exact=False`): multiply decode- and verify-sized inputs (1-16 rows) through the
        kernel measured fastest on this CPU per weight shape and row count, on weights packed
        for it on first use (`models.packed`: plain sgemm, MKL's packed sgemm or oneDNN).
        `dtype`: a torch dtype, "auto" or None (default: bf16 on CUDA; on a CPU bf16 where its
        products measure faster than fp32's, else fp32: `precision.auto_dtype`; the engine's
        `dtype_reason` says why), or
        `dtype="q4_1"`, which runs the target's linear layers from 4-bit weights (CPU; for the default
        target the GGUF file's own values, see `models.quant`); drafters as `draft_weights` says.
        `draft_weights`: "int8" runs the drafters' linear layers (and their share of the LM head)
        from int8 copies of their weights (CPU; `draft_head.quantize_drafter`): a draft pass
        reads 4x fewer bytes, the output is the target's either way; "bf16": an fp32 target's
        DFlash drafters in bf16 through the native pass (a CPU with AVX512-BF16); "float": the
        target's floating dtype; "auto" (default): bf16 where that runs for an fp32 target, else
        int8 for fp32 drafters on CPU, else float (`resolve_draft_weights`).
        `exact` (default): every product and attention row-independent (`models.exact`), so that
        a token verified in a block or a tree gets bit for bit the logits it gets decoded alone
        (q4_1 targets are made so by `models.quant`); `exact=False`: fp32 products through the
        kernel measured fastest per row count (`packed`), bf16 / fp16 through `F.linear`."""
        dev = default_device()
        if dtype == "auto":
            dtype = None
        if dtype in ("float32", "bfloat16", "float16"):  # a dtype by name, as the CLI's --dtype says it
            dtype = getattr(torch, dtype)
        quantized = dtype if isinstance(dtype, str) else None
        reason = "chosen"
        if quantized is not None:
            from .models.quant import QUANTIZED

            if quantized not in QUANTIZED:
                raise BlockdraftError(
                    f"unknown weight format {quantized!r}; choose a torch dtype or one of {', '.join(QUANTIZED)}"
                )
            dev, dtype = torch.device("cpu"), torch.float32
        device = torch.device(device or dev)
        if dtype is None:
            choice = auto_dtype(device)
            dtype, reason = choice.dtype, choice.reason
        elif quantized is None:
            reason = explain(dtype, device)
        draft_weights = resolve_draft_weights(draft_weights, device, dtype)
        folder = Path(target) if target else default_target_dir()
        model = load_target(folder, device, dtype)
        if quantized is not None:
            from .models.default import gguf_path
            from .models.quant import quantize_target

            quantize_target(model, gguf_path() if target is None else None)
        tokenizer = load_tokenizer(folder)
        packed = packed and packing_available()  # (a quantized target has no fp32 linears left; drafters do)
        if exact and quantized is None:
            make_exact(model)
        if packed:  # the linear layers exact mode left (none, but on a target it cannot make exact)
            pack_linears(model)
        note = None
        if use_draft and draft is None:
            draft = shipped_drafter(drafters.PRIMARY) if target is None else None
            if draft is None:
                note = "no trained drafter is shipped for this target yet: pass --draft DIR, or use --method ar"
        engine = cls(
            model,
            tokenizer,
            None,
            target_name=str(folder),
            draft_note=note,
            default_target=target is None,
            packed=packed,
            draft_weights=draft_weights,
        )
        engine.dtype_reason = reason
        for name, path in ((drafters.PRIMARY, draft if use_draft else None), ("eagle3", eagle)):
            if path is not None:
                setattr(engine, drafters.kind(name).engine_slot, engine.load_drafter(name, path))
        return engine

    def precision(self) -> dict:
        """What the target runs in and why: {"dtype", "dtype_reason", "exact", "step", "draft"}
        ("exact": every verified token's logits are, bit for bit, those of a plain step, see
        `models.exact`; "step": "native" for the fused step of `models.native_step`, else
        "eager: <why>"; "draft": the same for the DFlash drafter's pass, `draft_native`, None
        without a drafter)."""
        exactness = getattr(self.target, "exactness", None)
        quantization = getattr(self.target, "quantization", None)
        exact = exactness["exact"] if exactness else bool(quantization and quantization.get("exact_attention"))
        step = (exactness or {}).get("step") or ("eager: quantized weights" if quantization else "eager")
        drafter = getattr(self, "drafter", None)
        draft = None if drafter is None else getattr(drafter, "draft_pass", "eager")
        return {"dtype": self.weights, "dtype_reason": self.dtype_reason, "exact": exact, "step": step, "draft": draft}

    def load_drafter(self, kind: str, folder):
        """A drafter folder of that kind, ready to decode with this engine's target, draft weights
        and packing (`drafters.load_drafter`)."""
        return drafters.load_drafter(kind, folder, self.target, draft_weights=self.draft_weights, packed=self.packed)

    def drafter_for(self, kind: str):
        """The loaded drafter of a kind (see `drafters.KINDS`: "dflash", "eagle3"); the one
        shipped for the default target is loaded on first use."""
        spec = drafters.kind(kind)
        if getattr(self, spec.engine_slot) is None:
            folder = shipped_drafter(spec.name) if self.default_target else None
            if folder is None:
                if spec.engine_slot == "drafter" and self.draft_note:
                    raise BlockdraftError(self.draft_note)
                raise BlockdraftError(f"method {spec.name} needs a {spec.label} for this target: pass {spec.flag} DIR")
            setattr(self, spec.engine_slot, self.load_drafter(spec.name, folder))
        return getattr(self, spec.engine_slot)

    # ---- prompts -------------------------------------------------------------------

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if not isinstance(prompt, str):
            raise BlockdraftError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not prompt:
            raise BlockdraftError("empty prompt")
        if chat:
            return chat_prompt_ids(self.tokenizer, prompt)
        return self.tokenizer(prompt).input_ids

    def proposer(self, method: str | SpecConfig) -> Proposer:
        """A fresh proposer for a registered method (see `blockdraft.methods`)."""
        return SpecConfig.of(method).build(self).proposer

    # ---- generation ----------------------------------------------------------------

    def generate(
        self,
        prompts,
        *,
        chat: bool = False,
        method: str | SpecConfig = "dflash",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        block_size: int | None = None,
        proposer: Proposer | None = None,
        shared_prefix: list[int] | None = None,
        on_text: Callable[[int, str], None] | None = None,
        cancel: threading.Event | None = None,
        grammar: GrammarSpec | Grammar | None = None,
    ):
        """Generate for one prompt (returns a `Generation`) or a list of them (returns a list).

        Prompts are strings (with `chat=True`, wrapped in the target's chat template as one
        user turn) or lists of token ids. Greedy when temperature is 0; otherwise samples
        with temperature / top-p / top-k, reproducibly for a given seed (row i of a batch
        uses seed + i). `method`: a registered method ("dflash", "dflash@8", see
        `blockdraft.methods`) or a `SpecConfig` (adds the draft window and fixed/adaptive
        speculation). `on_text(i, delta)` receives new text of prompt i as it is accepted.
        Setting `cancel` (a threading.Event) ends generation after the current step; the
        results then hold what was generated so far (finish reason "abort").
        `shared_prefix`: token ids that many of the prompts start with, prefilled once and
        copied into their rows (outputs equal up to floating-point rounding).
        `grammar`: structured output for every prompt, a `GrammarSpec` (e.g.
        `GrammarSpec("json_schema", schema)`, "json_object", "regex", "choice", "lark") or a compiled
        `Grammar`; every method's output then equals `ar`'s under the same grammar.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        spec = SpecConfig.of(method, block_size).build(self, proposer)  # 'dflash@8', 'dflash-tree@32'
        proposer, block_size = spec.proposer, spec.block
        compiled = self.grammar(grammar)
        rows = [
            self.make_row(
                self.encode(prompt, chat),
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                None if seed is None else seed + i,
                stop,
                compiled,
            )
            for i, prompt in enumerate(batch)
        ]
        states: list[SequenceState] = []
        steps = []
        t0 = time.perf_counter()
        for step in generate_steps(
            self.target,
            proposer,
            [r.request for r in rows],
            block_size,
            states,
            shared_prefix=shared_prefix,
            adaptive=spec.adaptive,
        ):
            steps.append(step)
            if cancel is not None and cancel.is_set():
                for state in states:
                    state.finish_reason = state.finish_reason or "abort"
                break
            if on_text is not None:
                for i, (row, state) in enumerate(zip(rows, states, strict=False)):
                    if step.new_ids.get(i) or state.finished:
                        delta = self.text_delta(row, state)
                        if delta:
                            on_text(i, delta)
        elapsed = time.perf_counter() - t0
        results = [
            self._result(row, state, steps, elapsed, spec.method, block_size)
            for row, state in zip(rows, states, strict=False)
        ]
        return results[0] if single else results

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Yield the new text of one prompt as the verifier accepts it. Closing the iterator
        (or dropping it) stops generation after the current step."""
        import queue

        pieces: queue.Queue = queue.Queue()
        done = object()
        error: list[BaseException] = []
        cancel = threading.Event()

        def work():
            try:
                self.generate(prompt, on_text=lambda _i, text: pieces.put(text), cancel=cancel, **kwargs)
            except BaseException as exc:  # re-raised in the caller's thread
                error.append(exc)
            finally:
                pieces.put(done)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            while (piece := pieces.get()) is not done:
                yield piece
        finally:
            cancel.set()
            thread.join()
        if error:
            raise error[0]

    # ---- helpers -------------------------------------------------------------------

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in the target's chat template, ready for the answer."""
        return chat_prompt_ids(self.tokenizer, messages)

    def grammar(self, spec: GrammarSpec | Grammar | None) -> Grammar | None:
        """A grammar compiled for this target's tokenizer (kept: the same spec compiles once), or a
        one-line `BlockdraftError` for one that cannot be compiled or matches nothing."""
        from .grammar import Grammar, GrammarSpec

        if spec is None or isinstance(spec, Grammar):
            return spec
        if not isinstance(spec, GrammarSpec):
            raise BlockdraftError(f"grammar must be a GrammarSpec, not {type(spec).__name__}")
        import json

        key = (spec.kind, json.dumps(spec.source, sort_keys=True))
        with self._grammar_lock:  # the server's request threads compile concurrently
            cache = self._grammars
            if key not in cache:
                if len(cache) >= 64:  # a server sees many schemas: keep the newest
                    cache.pop(next(iter(cache)))
                cache[key] = Grammar(spec, self.tokenizer, self.target.config.vocab_size, tuple(self.stop_token_ids))
            return cache[key]

    def make_row(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        grammar=None,
    ) -> Row:
        """A request with its sampling parameters, stop tokens, stop strings and grammar (compiled:
        `Engine.grammar`)."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise BlockdraftError("stop strings must be non-empty")
        req = Request(
            list(prompt_ids),
            max_new_tokens,
            SamplingParams(temperature, top_p, top_k, seed),
            tuple(self.stop_token_ids),
            grammar=grammar,
        )
        row = Row(req, TextStream(self.tokenizer, stops), stops)
        if stops:

            def check(ids: list[int]) -> int | None:  # incremental: only new text is decoded and searched
                row.stream.feed(ids)
                return row.stream.stop_keep

            req.stop_check = check
        return row

    def text_delta(self, row: Row, state: SequenceState) -> str:
        """New text of a row since the last call (held back while it may still change)."""
        row.stream.feed(state.output_ids, final=state.finished)
        return row.stream.delta(state.finished)

    def final_text(self, row: Row, state: SequenceState) -> str:
        row.stream.feed(state.output_ids, final=True)
        return row.stream.final_text

    def _result(self, row: Row, state: SequenceState, steps, elapsed, method, block_size) -> Generation:
        lengths = state.acceptance_lengths
        n = len(state.output_ids)
        return Generation(
            text=self.final_text(row, state),
            token_ids=list(state.output_ids),
            num_prompt_tokens=len(row.request.prompt_ids),
            num_output_tokens=n,
            acceptance_lengths=list(lengths),
            tau=sum(lengths) / len(lengths) if lengths else 0.0,
            decode_seconds=elapsed,
            tokens_per_second=n / elapsed if elapsed > 0 else 0.0,
            finish_reason=state.finish_reason or "length",
            method=method,
            block_size=block_size,
            prefill_seconds=sum(s.prefill_seconds for s in steps),
            draft_seconds=sum(s.draft_seconds for s in steps),
            verify_seconds=sum(s.verify_seconds for s in steps),
            grammar_seconds=sum(s.grammar_seconds for s in steps),
            steps=len(lengths),
        )
