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

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from .decode import Request, SequenceState, generate_steps
from .draft import DFlashDrafter
from .errors import BlockdraftError
from .models import Transformer, eos_token_ids, load_target, load_tokenizer
from .models.default import DEFAULT_TARGET_NAME, default_target_dir
from .models.packed import pack_linears
from .proposers import DFlashProposer, EagleProposer, LookupProposer, Proposer
from .sampling import SamplingParams

REPO_MODELS = Path(__file__).resolve().parent.parent / "models"
SHIPPED_DRAFTS = {DEFAULT_TARGET_NAME: REPO_MODELS / "smollm2-135m-instruct-dflash"}
METHODS = ("dflash", "ar", "lookup", "eagle3")


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
    steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Row:
    request: Request
    stops: list[str] = field(default_factory=list)
    sent: str = ""  # text already streamed


def default_device() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


class Engine:
    def __init__(self, target: Transformer, tokenizer, drafter: DFlashDrafter | None = None,
                 target_name: str = "", draft_note: str | None = None, eagle=None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.eagle = eagle  # an EAGLE-3-style baseline drafter, for comparisons
        if eagle is not None:
            eagle.check_target(target.config)
        self.target_name = target_name
        self.draft_note = draft_note  # why there is no drafter, when there is none
        if drafter is not None:
            drafter.check_target(target.config)
        eos = set(eos_token_ids(target_name)) if target_name else set()
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.stop_token_ids = sorted(eos)

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
             device=None, dtype: torch.dtype | None = None, use_draft: bool = True,
             eagle: str | Path | None = None, packed: bool = True) -> "Engine":
        """Load a target folder (default: SmolLM2-135M-Instruct) and a drafter folder
        (default: the one shipped for that target, if any). `use_draft=False` skips it.
        `eagle` names an EAGLE-3-style drafter folder (method "eagle3", for comparisons).
        `packed` (fp32 on CPU with MKL): multiply verify-sized inputs by prepacked weights
        (`models.packed`; about 3x each model's weight memory per packed size, made on first use)."""
        dev, dt = default_device()
        device, dtype = torch.device(device or dev), dtype or dt
        folder = Path(target) if target else default_target_dir()
        model = load_target(folder, device, dtype)
        tokenizer = load_tokenizer(folder)
        drafter, note = None, None
        if use_draft:
            if draft is None:
                shipped = SHIPPED_DRAFTS.get(DEFAULT_TARGET_NAME) if target is None else None
                if shipped is not None and (shipped / "config.json").is_file():
                    draft = shipped
                else:
                    note = ("no trained drafter is shipped for this target yet: pass --draft DIR, "
                            "or use --method ar")
            if draft is not None:
                drafter = DFlashDrafter.load(draft, device, dtype)
        baseline = None
        if eagle is not None:
            from .eagle import EagleDrafter

            baseline = EagleDrafter.load(eagle, device, dtype)
        if packed:
            for module in (model, drafter, baseline):
                if module is not None:
                    pack_linears(module)
        return cls(model, tokenizer, drafter, target_name=str(folder), draft_note=note, eagle=baseline)

    # ---- prompts -------------------------------------------------------------------

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if not isinstance(prompt, str):
            raise BlockdraftError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not prompt:
            raise BlockdraftError("empty prompt")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(prompt).input_ids

    def proposer(self, method: str) -> Proposer:
        if method == "ar":
            return Proposer()
        if method == "lookup":
            return LookupProposer()
        if method == "eagle3":
            if self.eagle is None:
                raise BlockdraftError("method eagle3 needs an EAGLE-3-style drafter: pass --eagle DIR")
            return EagleProposer(self.eagle, self.target)
        if method == "dflash":
            if self.drafter is None:
                raise BlockdraftError(self.draft_note or "method dflash needs a drafter: pass --draft DIR")
            return DFlashProposer(self.drafter, self.target)
        raise BlockdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")

    # ---- generation ----------------------------------------------------------------

    def generate(self, prompts, *, chat: bool = False, method: str = "dflash", max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: str | list[str] | None = None, block_size: int | None = None,
                 proposer: Proposer | None = None,
                 on_text: Callable[[int, str], None] | None = None):
        """Generate for one prompt (returns a `Generation`) or a list of them (returns a list).

        Prompts are strings (with `chat=True`, wrapped in the target's chat template as one
        user turn) or lists of token ids. Greedy when temperature is 0; otherwise samples
        with temperature / top-p / top-k, reproducibly for a given seed (row i of a batch
        uses seed + i). `on_text(i, delta)` receives new text of prompt i as it is accepted.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        proposer = proposer or self.proposer(method)
        if block_size is None:
            block_size = proposer.default_block_size or proposer.max_block_size or 1
        rows = [self.make_row(self.encode(prompt, chat), max_new_tokens, temperature, top_p, top_k,
                              None if seed is None else seed + i, stop) for i, prompt in enumerate(batch)]
        states: list[SequenceState] = []
        steps = []
        t0 = time.perf_counter()
        for step in generate_steps(self.target, proposer, [r.request for r in rows], block_size, states):
            steps.append(step)
            if on_text is not None:
                for i, (row, state) in enumerate(zip(rows, states)):
                    if step.new_ids.get(i) or state.finished:
                        delta = self.text_delta(row, state)
                        if delta:
                            on_text(i, delta)
        elapsed = time.perf_counter() - t0
        results = [self._result(row, state, steps, elapsed, proposer.name, block_size)
                   for row, state in zip(rows, states)]
        return results[0] if single else results

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Yield the new text of one prompt as the verifier accepts it."""
        import queue
        import threading

        pieces: queue.Queue = queue.Queue()
        done = object()
        error: list[BaseException] = []

        def work():
            try:
                self.generate(prompt, on_text=lambda _i, text: pieces.put(text), **kwargs)
            except BaseException as exc:  # re-raised in the caller's thread
                error.append(exc)
            finally:
                pieces.put(done)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        while (piece := pieces.get()) is not done:
            yield piece
        thread.join()
        if error:
            raise error[0]

    # ---- helpers -------------------------------------------------------------------

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in the target's chat template, ready for the answer."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def make_row(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None) -> _Row:
        """A request with its sampling parameters, stop tokens and stop strings."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise BlockdraftError("stop strings must be non-empty")
        req = Request(list(prompt_ids), max_new_tokens, SamplingParams(temperature, top_p, top_k, seed),
                      tuple(self.stop_token_ids))
        if stops:
            req.stop_check = self._stop_checker(stops)
        return _Row(req, stops)

    def _stop_checker(self, stops: list[str]):
        def check(ids: list[int]) -> int | None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if not any(s in text for s in stops):
                return None
            keep = len(ids)  # shortest prefix whose text already contains a stop string
            while keep > 1 and any(s in self.tokenizer.decode(ids[: keep - 1], skip_special_tokens=True)
                                   for s in stops):
                keep -= 1
            return keep
        return check

    def _final_text(self, row: _Row, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in row.stops if s in text]
        return text[: min(cuts)] if cuts else text

    def text_delta(self, row: _Row, state: SequenceState) -> str:
        """New text of a row since the last call (held back while it may still change)."""
        text = self._final_text(row, state.output_ids)
        if not state.finished:
            if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                return ""
            for s in row.stops:  # hold back what may turn out to be the start of a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        text = text[:-k]
                        break
        if not text.startswith(row.sent):
            return ""
        delta, row.sent = text[len(row.sent):], text
        return delta

    def _result(self, row: _Row, state: SequenceState, steps, elapsed, method, block_size) -> Generation:
        lengths = state.acceptance_lengths
        n = len(state.output_ids)
        return Generation(
            text=self._final_text(row, state.output_ids),
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
            prefill_seconds=sum(s.total_seconds for s in steps if s.prefill),
            draft_seconds=sum(s.draft_seconds for s in steps),
            verify_seconds=sum(s.verify_seconds for s in steps if not s.prefill),
            steps=len(lengths),
        )

