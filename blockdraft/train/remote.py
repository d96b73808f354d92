"""Regeneration through any OpenAI-compatible chat endpoint (vLLM, SGLang, `blockdraft serve`).

The same prompts, shards and resumption as in-process regeneration (`data.regenerate`); only
the answers come from a server, `concurrency` requests in flight. Answer token ids come from
the response when the server returns them (`return_token_ids`, as vLLM and `blockdraft serve`
do), else from the target's tokenizer on the returned text (plus the end-of-turn token when the
answer stopped there); how often such a round trip does not reproduce the text is reported.

A request that fails (connection dropped, 5xx, 429) is retried with backoff; when the server
stays away the run stops with every finished sample written, and the next run resumes.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from collections.abc import Iterator

import httpx

from ..errors import BlockdraftError
from ..sampling import SamplingParams
from .answers import AnswerSampling, make_sample

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass
class Answer:
    answer_ids: list[int]
    finish_reason: str
    prompt_ids: list[int] | None  # the server's, when it says
    from_text: bool  # ids from tokenizing the text (the server returned none)
    round_trip_ok: bool  # (from text) decoding the ids gives the text back


def end_of_turn_id(tokenizer, stop_token_ids: list[int]) -> int | None:
    """The stop token the chat template closes an assistant turn with (what a greedy answer that
    stopped ends with in our samples), found by rendering a short conversation."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    found = [t for t in ids if t in set(stop_token_ids)]
    return found[-1] if found else tokenizer.eos_token_id


class RemoteTarget:
    """A chat-completions endpoint and the target's tokenizer (prompts are made here, the same
    way as in-process; answers are tokenized here when the server returns text only)."""

    def __init__(
        self,
        url: str,
        tokenizer,
        stop_token_ids: list[int],
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        retries: int = 8,
        concurrency: int = 64,
        ask_token_ids: bool = True,
    ):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.end_of_turn = tokenizer, end_of_turn_id(tokenizer, stop_token_ids)
        self.retries = retries
        self.ask_token_ids = ask_token_ids  # request `return_token_ids` (False: for servers that reject it)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )
        self.model = model or self._request("GET", "/v1/models")["data"][0]["id"]

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        delay = 1.0
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, self.url + path, json=body)
                if response.status_code not in RETRY_STATUS:
                    if response.status_code != 200:
                        kind = Refused if response.status_code == 400 else BlockdraftError
                        raise kind(f"{self.url}{path}: HTTP {response.status_code}: {response.text[:300]}")
                    return response.json()
                problem = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                time.sleep(delay)
                delay = min(2 * delay, 30.0)
        raise ServerGone(f"{self.url} did not answer after {self.retries + 1} tries ({problem})")

    def answer(self, messages: list[dict], *, max_tokens: int, sampling: SamplingParams) -> Answer:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
        }
        if sampling.top_k > 0:  # an extension (vLLM, SGLang, blockdraft serve); sent only when it cuts
            body["top_k"] = sampling.top_k
        if self.ask_token_ids:
            body["return_token_ids"] = True
        reply = self._request("POST", "/v1/chat/completions", body)
        choice = reply["choices"][0]
        finish = choice.get("finish_reason") or "length"
        ids = choice.get("token_ids")
        if ids is not None:
            return Answer(list(ids), finish, reply.get("prompt_token_ids"), False, True)
        text = (choice.get("message") or {}).get("content") or ""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        ok = self.tokenizer.decode(ids) == text
        if finish == "stop" and self.end_of_turn is not None:
            ids.append(self.end_of_turn)
        return Answer(ids, finish, None, True, ok)

    def close(self):
        self.http.close()


class ServerGone(BlockdraftError):
    """The server stayed unreachable through every retry."""


class Refused(BlockdraftError):
    """The server refused one request (HTTP 400, e.g. a prompt too long for it); others go on."""


def answer_prompts_remote(
    remote: RemoteTarget,
    prompts: Iterator[dict],
    *,
    max_new_tokens: int,
    concurrency: int,
    sampling: AnswerSampling,
    stats,
    seconds: float | None = None,
    until=None,
    on_sample=None,
    bar=None,
):
    """Keep `concurrency` requests in flight; each finished answer goes to `on_sample` (in the
    calling thread) as soon as it arrives. Stops when the prompts run out, after `seconds` or
    once `until(stats)` holds (requests in flight are then dropped: redone next run), or when
    the server is gone (raises ServerGone after the finished answers are written)."""
    t0 = time.perf_counter()
    inflight = {}
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="regen")
    exhausted, gone = False, None
    try:
        while True:
            stats.seconds = time.perf_counter() - t0
            stop = (seconds is not None and stats.seconds >= seconds) or (until is not None and until(stats))
            while not (stop or exhausted or gone) and len(inflight) < concurrency:
                p = next(prompts, None)
                if p is None:
                    exhausted = True
                    break
                future = pool.submit(
                    remote.answer, p["messages"], max_tokens=max_new_tokens, sampling=sampling.params(p["id"])
                )
                inflight[future] = p
            if not inflight or stop:
                break
            done, _ = wait(inflight, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                p = inflight.pop(future)
                try:
                    answer = future.result()
                except ServerGone as exc:
                    gone = exc  # finish what is still arriving, then stop
                    continue
                except Refused as exc:  # this prompt only (e.g. too long for the server): redone next run
                    stats.rejected += 1
                    stats.last_rejection = str(exc)
                    continue
                stats.tokens += len(answer.answer_ids)
                stats.prompt_tokens += len(p["prompt_ids"])
                stats.from_text += answer.from_text
                stats.round_trip_mismatches += not answer.round_trip_ok
                if answer.prompt_ids is not None and answer.prompt_ids != p["prompt_ids"]:
                    stats.prompt_mismatches += 1
                    p = {**p, "prompt_ids": answer.prompt_ids}  # what the answer actually continues
                if on_sample is not None:
                    on_sample(
                        make_sample(
                            p,
                            answer.answer_ids,
                            answer.finish_reason,
                            method=f"server:{remote.model}",
                            sampling=sampling,
                            max_new_tokens=max_new_tokens,
                        )
                    )
                stats.written += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{stats.tokens / (time.perf_counter() - t0):.0f}", inflight=len(inflight))
            stats.timeline.append((time.perf_counter() - t0, stats.tokens, stats.prompt_tokens, stats.written))
    finally:  # requests still in flight are dropped (redone next run); nobody waits for them
        pool.shutdown(wait=False, cancel_futures=True)
    stats.seconds = time.perf_counter() - t0
    if gone is not None:
        raise gone
    return stats
