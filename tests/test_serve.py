"""`blockdraft serve` against a real server process on loopback, with the official client.

The oracle for every greedy answer is offline `Engine.generate` on the same weights.
"""

import json
import re
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdraft.engine import Engine
from blockdraft.sequences import Request
from blockdraft.serve.client import ServerProcess, stream_chat
from blockdraft.serve.scheduler import Scheduler

from .test_decode import RiggedProposer

KEY = "test-key"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, random_drafter):
    path = tmp_path_factory.mktemp("drafts") / "random"
    random_drafter.save(path)
    return path


@pytest.fixture(scope="module")
def server(draft_dir):
    s = ServerProcess(
        "--draft",
        str(draft_dir),
        "--api-key",
        KEY,
        "--max-tokens",
        str(MAX_TOKENS),
        "--max-batch",
        "8",
        "--max-queue",
        "64",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "smol",
        "--block-size",
        "8",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(draft_dir):
    return Engine.load(draft=draft_dir)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def offline(engine, prompt, chat=True, n=MAX_TOKENS):
    return engine.generate(prompt, chat=chat, method="dflash", max_new_tokens=n, block_size=8)


def post(server, path, body=None, content=None, headers=None, key=KEY):
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json", **h}, timeout=300
    )


def test_openai_client_completions_chat_and_streaming(client, engine):
    assert [m.id for m in client.models.list().data] == ["smol"]
    prompt = "Give me three tips for sleeping better."
    ref = offline(engine, prompt)
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.completion_tokens == ref.num_output_tokens
    assert chat.usage.prompt_tokens == ref.num_prompt_tokens
    assert chat.choices[0].finish_reason == ref.finish_reason

    pieces, finish = [], None
    for chunk in client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == ref.text and finish == ref.finish_reason
    assert sum(1 for p in pieces if p) > 1  # streamed in pieces, not in one go

    raw = "def quicksort(arr):"
    ref = offline(engine, raw, chat=False, n=20)
    out = client.completions.create(model="smol", prompt=raw, max_tokens=20, temperature=0)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == ref.num_output_tokens
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="smol", prompt=raw, max_tokens=20, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == ref.text
    # stop strings and seeded sampling
    stopped = client.completions.create(model="smol", prompt=raw, max_tokens=20, temperature=0, stop=["\n"])
    assert stopped.choices[0].text == ref.text.split("\n")[0] and stopped.choices[0].finish_reason == "stop"
    a, b = (
        client.completions.create(model="smol", prompt=raw, max_tokens=12, temperature=1.0, seed=7) for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text
    sampled = engine.generate(raw, method="dflash", max_new_tokens=12, temperature=1.0, seed=7, block_size=8)
    assert a.choices[0].text == sampled.text


def test_openai_client_usage_chunk_and_error_classes(client, server):
    """The official client: `stream_options.include_usage` gives a last chunk with no choices and
    the same usage as the answer without streaming; a bad parameter, a wrong API key and an unknown
    model come back as the client's BadRequestError, AuthenticationError and NotFoundError."""
    import openai

    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smol",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smol", messages=messages, max_tokens=8, logprobs=True, top_logprobs=21)
    assert bad.value.status_code == 400 and bad.value.param == "top_logprobs"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


def test_logprobs_parameters_are_checked(server):
    """`logprobs` / `top_logprobs` outside OpenAI's ranges or types get a 400 naming the field."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra, param in [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as OpenAI
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
    ]:
        r = post(server, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    for extra, param in [
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 2.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
    ]:
        r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    off = post(server, "/v1/chat/completions", {**chat, "logprobs": False}).json()
    assert off["choices"][0]["logprobs"] is None
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": None}).status_code == 200


@pytest.fixture(scope="module")
def shipped_server():
    """The shipped DFlash drafter (it accepts several tokens per step), full blocks every step."""
    # fp32: its logprobs are compared with HF's fp32 log-softmax (auto is bf16 on some CPUs)
    s = ServerProcess(
        "--speculation",
        "fixed",
        "--max-tokens",
        "32",
        "--max-batch",
        "4",
        "--served-model-name",
        "smol",
        "--dtype",
        "float32",
    )
    yield s
    s.stop()


def hf_log_softmax(hf_smol, prompt_ids, output_ids):
    """HF transformers' own log-softmax at every generated position (the oracle)."""
    import torch

    with torch.no_grad():
        logits = hf_smol(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]


def test_logprobs_equal_hf_log_softmax_through_speculative_steps(shipped_server, hf_smol, tokenizer):
    """Greedy DFlash with several tokens accepted per verify step: every returned logprob (chat
    with top_logprobs 3, legacy completions with logprobs 3) is HF's log-softmax over prompt +
    generated tokens within 1e-4, the top tokens are HF's top 3 in order, the bytes add up to the
    tokens' text, text_offset points into the text; a request beside it without logprobs gets
    the same tokens as alone."""
    url = shipped_server.url

    def ask(path, body):
        r = httpx.post(
            url + path, json={"temperature": 0, "max_tokens": 16, "return_token_ids": True, **body}, timeout=300
        )
        assert r.status_code == 200, r.text
        return r.json()

    def text_of(token_id):  # a whole-character token's text (None for part of a UTF-8 character)
        text = tokenizer.decode([token_id])
        return None if "\ufffd" in text else text

    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    plain, out = {}, {}
    beside = threading.Thread(target=lambda: plain.setdefault("r", ask("/v1/chat/completions", {"messages": messages})))
    beside.start()
    out["chat"] = ask("/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 3})
    beside.join()
    chat = out["chat"]
    ids = chat["choices"][0]["token_ids"]
    assert plain["r"]["choices"][0]["token_ids"] == ids and plain["r"]["choices"][0]["logprobs"] is None
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) == chat["usage"]["completion_tokens"] > 4
    oracle = hf_log_softmax(hf_smol, chat["prompt_token_ids"], ids)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == tokenizer.decode(ids)
    for i, (tok, e) in enumerate(zip(ids, content, strict=False)):
        assert abs(e["logprob"] - oracle[i, tok].item()) < 1e-4, (i, e, oracle[i, tok])
        values, top = oracle[i].topk(3)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the chosen token is the most likely
        for t, want in zip(e["top_logprobs"], top.tolist(), strict=False):
            assert text_of(want) is None or t["token"] == text_of(want), (i, t, want)

    prompt = "The three primary colours are"
    done = ask("/v1/completions", {"prompt": prompt, "logprobs": 3})
    ids, lp = done["choices"][0]["token_ids"], done["choices"][0]["logprobs"]
    text = done["choices"][0]["text"]
    oracle = hf_log_softmax(hf_smol, done["prompt_token_ids"], ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) > 4
    for i, tok in enumerate(ids):
        assert abs(lp["token_logprobs"][i] - oracle[i, tok].item()) < 1e-4
        values, top = oracle[i].topk(3)
        assert sorted(lp["top_logprobs"][i].values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-4)
        assert text_of(tok) is None or lp["tokens"][i] == text_of(tok)
        end = lp["text_offset"][i + 1] if i + 1 < len(ids) else len(text)
        if text_of(tok) is not None and tok not in tokenizer.all_special_ids:
            assert text[lp["text_offset"][i] : end] == text_of(tok), i
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    metrics = httpx.get(url + "/metrics").text  # verify steps accepted two drafts and more
    accepted = re.search(r'blockdraft_spec_accepted_tokens_total\{position="2"\} ([0-9.e+]+)', metrics)
    assert accepted and float(accepted.group(1)) > 0


def test_decode_loop_logprobs_on_tree_paths_and_rows_that_did_not_ask(hf_smol):
    """In the loop itself, with the shipped drafter's trees (a path of several nodes accepted per
    step): a row that asks gets HF's log-softmax and top 2 at each token; the row beside it, which
    did not ask, gets no scores and exactly the tokens it gets in a batch where nobody asks."""
    from blockdraft.batcher import generate_steps

    engine = Engine.load(dtype="float32")  # HF's fp32 log-softmax is the oracle
    prompts = [engine.encode(p, chat=True) for p in ("Count to ten.", "Name three colours.")]

    def run(ask):
        rows = [engine.make_row(p, 12) for p in prompts]
        rows[0].request.logprobs = 2 if ask else None
        states, tree = [], engine.proposer("dflash-tree")
        for _ in generate_steps(engine.target, tree, [r.request for r in rows], tree.default_block_size, states):
            pass
        return states

    asked, plain = run(True), run(False)
    assert plain[1].output_ids == asked[1].output_ids and asked[1].logprobs == [] == plain[0].logprobs
    state = asked[0]
    assert state.output_ids == plain[0].output_ids and max(state.acceptance_lengths) > 2
    oracle = hf_log_softmax(hf_smol, prompts[0], state.output_ids)
    assert len(state.logprobs) == len(state.output_ids)
    for i, (tok, (logprob, top)) in enumerate(zip(state.output_ids, state.logprobs, strict=False)):
        values, ids = oracle[i].topk(2)
        assert abs(logprob - oracle[i, tok].item()) < 1e-4 and [t for t, _ in top] == ids.tolist(), i
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_streamed_logprobs_add_up_to_the_answers_logprobs(shipped_server):
    """Streamed chunks carry the logprobs of their tokens: concatenated, they equal the answer's
    without streaming (official client for chat, raw events for completions)."""
    from openai import OpenAI

    client = OpenAI(base_url=shipped_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kw = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Describe rain in one sentence."}],
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kw)
    streamed, text, carrying = [], "", 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                streamed += c.logprobs.content
                carrying += bool(c.logprobs.content)
    assert text == whole.choices[0].message.content and carrying > 1
    want = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in want] and len(want) == whole.usage.completion_tokens
    for a, b in zip(streamed, want, strict=False):
        assert a.bytes == b.bytes and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]

    body = {"prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0, "logprobs": 2}
    whole = httpx.post(shipped_server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    with httpx.stream("POST", shipped_server.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    for k, v in (c["logprobs"] or {}).items():
                        joined[k] += v
    assert text == whole["text"]
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert [sorted(d) for d in joined["top_logprobs"]] == [sorted(d) for d in whole["logprobs"]["top_logprobs"]]
    assert joined["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)


def _stream_chat(server, prompt, max_tokens, out, i):
    r = stream_chat(server.url, [{"role": "user", "content": prompt}], max_tokens=max_tokens, api_key=KEY, model="smol")
    assert r["status"] == 200, r
    out[i] = (r["text"], r["finish_reasons"], r["done"])


@pytest.mark.slow
def test_32_concurrent_streams_equal_offline_greedy(server, engine):
    check_streams(*start_streams(server, engine, 32, 16))


def start_streams(server, engine, n: int, max_tokens: int):
    """n chat streams started on threads, and their offline greedy references."""
    prompts = [f"Write one sentence about the number {i}." for i in range(n)]
    refs = engine.generate(prompts, chat=True, method="dflash", max_new_tokens=max_tokens, block_size=8)
    out = {}
    threads = [
        threading.Thread(target=_stream_chat, args=(server, p, max_tokens, out, i)) for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    return threads, refs, out


def check_streams(threads, refs, out):
    for t in threads:
        t.join()
    for i, ref in enumerate(refs):
        text, finishes, done = out[i]
        assert done and finishes == [ref.finish_reason], i
        assert text == ref.text, f"stream {i}: {text!r} != {ref.text!r}"


def test_greedy_answer_unchanged_while_16_streams_run(server, engine, client):
    prompt = "Explain what a hash table is to a ten-year-old."
    ref = offline(engine, prompt)
    out = {}
    background = [
        threading.Thread(target=_stream_chat, args=(server, f"Count to {i + 5}.", MAX_TOKENS, out, i))
        for i in range(16)
    ]
    for t in background:
        t.start()
    time.sleep(0.5)
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0
    )
    for t in background:
        t.join()
    assert chat.choices[0].message.content == ref.text
    assert len(out) == 16 and all(done and len(f) == 1 for _t, f, done in out.values())
    assert httpx.get(server.url + "/metrics").status_code == 401  # with --api-key, unless --metrics-public
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "blockdraft_acceptance_length_bucket" in metrics
    assert 'blockdraft_spec_drafted_tokens_total{position="1"}' in metrics
    assert "blockdraft_time_to_first_token_seconds_count" in metrics
    assert "blockdraft_running_batch_size" in metrics and "blockdraft_queue_depth" in metrics
    assert re.search(
        r'blockdraft_target_precision_info\{draft="[^"]+",dtype="\w+",exact="(true|false)",reason=".+",'
        r'step="[^"]+"\} 1',  # (labels in alphabetical order)
        metrics,
    )
    served = [
        line
        for line in metrics.splitlines()
        if line.startswith('blockdraft_requests_total{endpoint="chat",status="200"}')
    ]
    assert served and float(served[0].split()[-1]) >= 17


BAD = [
    (b"{not json", 400),
    (b"\xff\xfe\x00garbage", 400),
    (json.dumps([1, 2]).encode(), 400),
    (json.dumps({"messages": []}).encode(), 400),
    (json.dumps({"messages": "hi"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_p": 0}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [""]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}).encode(), 404),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 20000}]}).encode(), 400),
]


def test_bad_input_gets_openai_errors(server):
    for body, status in BAD:
        r = post(server, "/v1/chat/completions", content=body)
        assert r.status_code == status, (body[:60], r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    for body in ({"prompt": ""}, {"prompt": [10**9]}, {"prompt": {"a": 1}}, {}):
        assert post(server, "/v1/completions", body).status_code == 400
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    assert post(server, "/v1/completions", content=big).status_code == 413
    assert post(server, "/v1/completions", {"prompt": "hi"}, key="wrong").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/nothing-here").status_code in (401, 404)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_poisoned_requests_fail_alone_with_json_errors_while_streams_run(server, engine, client):
    """Requests that once aborted the running batch or got plain-text 500s (a top_k beyond 64
    bits, a lone surrogate, a 5000-digit integer) get OpenAI-shaped 400s; a temperature that
    underflows samples as greedy; the 15 streams running beside them are unchanged."""
    streams = start_streams(server, engine, 15, 24)  # 15 streams and the poisons: 16 and more at once
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    poisons = [
        (json.dumps({**chat, "temperature": 1, "top_k": 2**64}).encode(), "top_k"),
        (json.dumps({**chat, "temperature": 1, "top_k": 2**63}).encode(), "top_k"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 8}', "messages"),
        (b'{"prompt": "a\\ud800b", "max_tokens": 8}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 5000 + b"}", None),
        (json.dumps({**chat, "temperature": 10**400}).encode(), "temperature"),
    ]
    for body, param in poisons:
        path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
        r = post(server, path, content=body)
        assert r.status_code == 400, (body[:70], r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
    # text that cannot fit the context is refused before it is tokenized (by its length in characters)
    r = post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "ab " * 200_000}]})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    greedy = post(server, "/v1/chat/completions", {**chat, "temperature": 0}).json()
    for tiny in (1e-38, 1e-300):
        r = post(server, "/v1/chat/completions", {**chat, "temperature": tiny, "seed": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == greedy["choices"][0]["message"]
    check_streams(*streams)
    # features the server does not implement are refused, never ignored, and so are malformed tools and
    # response formats (tests/test_structured_serve.py); the prompt's own field is named
    for extra in (
        {"tools": [{"type": "function", "function": {}}]},
        {"functions": [{"name": "f"}]},
        {"response_format": {"type": "xml"}},
        {"best_of": 2},
        {"logit_bias": {"5": 1}},
    ):
        r = post(server, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), extra
    for extra in ({"echo": True}, {"suffix": "x"}):
        r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), extra
    long = post(server, "/v1/completions", {"prompt": "word " * 1100, "max_tokens": 4})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert post(server, "/v1/completions", {"prompt": "Hi"}, headers={"Content-Type": "text/plain"}).status_code == 415
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "trace-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7"
    assert httpx.get(server.url + "/openapi.json").status_code in (401, 404)
    # the model endpoint the official client's models.retrieve reads
    assert client.models.retrieve("smol").id == "smol"
    r = httpx.get(server.url + "/v1/models/other", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def counted(server, endpoint: str, status: int) -> float:
    """Requests /metrics counts for `endpoint` answered with `status`."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = re.search(rf'blockdraft_requests_total{{endpoint="{endpoint}",status="{status}"}} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_model_name_with_a_lone_surrogate_gets_a_json_404_counted_as_404(server):
    """`"model": "\\ud800"` once got a 500 (its 404 message could not be encoded) that /metrics
    counted as a 404: now a 404 whose message escapes the name, counted as the 404 it is."""
    for path, endpoint, body in [
        (
            "/v1/chat/completions",
            "chat",
            b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
        ),
        ("/v1/completions", "completions", b'{"model": "a\\ud800", "prompt": "hi", "max_tokens": 2}'),
    ]:
        before = {s: counted(server, endpoint, s) for s in (404, 500)}
        r = post(server, path, content=body)
        assert r.status_code == 404, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "\\ud800" in err["message"]
        assert "\n" not in err["message"]
        assert counted(server, endpoint, 404) == before[404] + 1 and counted(server, endpoint, 500) == before[500]


def test_unknown_fields_are_refused_and_unimplemented_ones_unless_neutral(server):
    """As OpenAI: a field the endpoint does not know gets a 400 "Unrecognized request argument
    supplied: NAME"; one OpenAI knows but this server does not implement (penalties, logit_bias)
    a 400 naming it, unless given at its neutral value."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    legacy = {"prompt": "Hi", "max_tokens": 2}
    for path, body, name in [
        ("/v1/chat/completions", {**chat, "temprature": 0}, "temprature"),
        ("/v1/completions", {**legacy, "foo": None}, "foo"),
        ("/v1/chat/completions", {**chat, "prompt": "Hi"}, "prompt"),  # the other endpoint's
        ("/v1/completions", {**legacy, "messages": chat["messages"]}, "messages"),
        ("/v1/chat/completions", {**chat, "echo": False}, "echo"),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == name, (body, err)
        assert err["message"] == f"Unrecognized request argument supplied: {name}"
    r = post(server, "/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2, "\\ud800": 1}')
    assert r.status_code == 400 and "\\ud800" in r.json()["error"]["message"], r.text
    for path, base in [("/v1/chat/completions", chat), ("/v1/completions", legacy)]:
        for extra in (
            {"presence_penalty": 0.5},
            {"frequency_penalty": -1},
            {"presence_penalty": "0"},
            {"logit_bias": {"5": 1}},
        ):
            r = post(server, path, {**base, **extra})
            name = next(iter(extra))
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, extra, r.text)
            assert "not supported" in r.json()["error"]["message"]
        neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u-1"}
        assert post(server, path, {**base, **neutral}).status_code == 200, path


def test_stream_options_needs_stream_true(server):
    """As OpenAI: `stream_options` is refused unless `stream` is true (`null` is no options)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra in (
        {"stream_options": {"include_usage": True}},
        {"stream": False, "stream_options": {"include_usage": False}},
    ):
        for path, base in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})]:
            r = post(server, path, {**base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", (path, extra, r.text)
            assert "only allowed when 'stream' is enabled" in r.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", {**chat, "stream_options": None}).status_code == 200


def test_stream_options_include_usage_must_be_a_boolean(server):
    """`include_usage: "no"` was read as true: now anything but a JSON boolean (or an unknown
    option) is a 400; `false` streams without a usage chunk."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    for options in ({"include_usage": "no"}, {"include_usage": 1}, {"include_usge": True}):
        for path, base in [
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
        ]:
            r = post(server, path, {**base, "stream_options": options})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", (path, options, r.text)
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=300,
        json={**chat, "stream_options": {"include_usage": False}},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and lines and not any('"usage"' in line for line in lines)


def test_the_bearer_scheme_is_case_insensitive(server):
    """HTTP auth schemes are case-insensitive: `bearer`, `BEARER` as `Bearer`."""
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    assert (
        post(
            server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": f"bearer {KEY}"}
        ).status_code
        == 200
    )


def test_a_401_carries_www_authenticate_bearer(server):
    """A refused key, a missing one or another scheme: 401 with `WWW-Authenticate: Bearer`."""
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer{KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
    ):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.headers.get("www-authenticate") == "Bearer", (headers, r.headers)
        assert r.json()["error"]["type"] == "authentication_error"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, key="wrong")
    assert r.status_code == 401 and r.headers.get("www-authenticate") == "Bearer"


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "n",
    "max_completion_tokens",
    "top_k",
    "stream_options",
    "logprobs",
    "top_logprobs",
]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": st.text(max_size=30) | JSONISH}
)
BODY = st.dictionaries(st.sampled_from(FIELDS), JSONISH | st.lists(MESSAGE, max_size=3), max_size=6)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    body=BODY, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw=st.none() | st.binary(max_size=64)
)
def test_random_bodies_never_5xx(server, body, path, raw):
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep accepted requests short
    body.setdefault("max_tokens", 4)
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    r = post(server, path, content=content)
    assert r.status_code < 500, (content[:200], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json()


@pytest.mark.slow
def test_server_still_correct_after_fuzzing(server, client, engine):
    """Runs after the property test (file order): the server answers correctly."""
    prompt = "List the planets of the solar system in order from the sun."
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == offline(engine, prompt).text


def test_queue_bound_disconnect_and_graceful_shutdown():
    """Also: with no --draft, the server runs the shipped drafter of the default target."""
    s = ServerProcess(
        "--max-batch", "1", "--max-queue", "1", "--max-tokens", "1000", "--block-size", "4", "--shutdown-grace", "60"
    )
    try:
        long = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}
        # a client that disconnects after the first chunk frees its slot: the next request (one
        # slot) runs after it, and the verify steps of both are fewer than the long one alone
        # needs for its 1,000 tokens at 4 a step (it was stopped, not run to its end)
        with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=60) as r:
            next(r.iter_lines())
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0}, timeout=300)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(s.url + "/metrics").text
        steps = float(re.search(r"^blockdraft_verify_steps_total ([0-9.e+]+)$", metrics, re.M).group(1))
        assert steps < 1000 / 4, "the disconnected stream kept its slot to the end"
        assert 'blockdraft_requests_total{endpoint="completions",status="499"} 1.0' in metrics
        # one running + one waiting: the next requests get 429 at once
        results = {}

        def send(i):
            results[i] = httpx.post(
                s.url + "/v1/completions", json={**long, "stream": False, "max_tokens": 60}, timeout=300
            )

        workers = [threading.Thread(target=send, args=(i,)) for i in range(5)]
        for w in workers:
            w.start()
            time.sleep(0.05)
        for w in workers:
            w.join()
        codes = sorted(r.status_code for r in results.values())
        assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}, codes
        assert all(r.headers.get("retry-after") == "1" for r in results.values() if r.status_code == 429)
        assert all(
            r.json()["choices"][0]["finish_reason"] == "length" for r in results.values() if r.status_code == 200
        )
        # graceful shutdown: an in-flight request still completes
        holder = {}
        w = threading.Thread(
            target=lambda: holder.setdefault(
                "r",
                httpx.post(s.url + "/v1/completions", json={**long, "stream": False, "max_tokens": 40}, timeout=300),
            )
        )
        w.start()
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        w.join()
        assert holder["r"].status_code == 200
        assert holder["r"].json()["usage"]["completion_tokens"] == 40
        # uvicorn re-raises the signal once it has shut down cleanly: killed by SIGTERM, no traceback
        assert s.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = s.proc.stdout.read().decode(errors="replace")
        assert "Traceback" not in log, log
    finally:
        s.stop()


def test_second_signal_and_taken_port():
    """The decode loop runs on the server's main thread: a second SIGTERM ends in-flight
    requests at once (finish_reason "length", OpenAI's value for a truncated answer, exit 0, no
    traceback); a server whose port is
    taken exits 1 instead of hanging with its loop waiting for work."""
    import subprocess
    import sys

    s = ServerProcess("--method", "ar", "--max-tokens", "1500", "--shutdown-grace", "120")
    try:
        taken = subprocess.run(
            [sys.executable, "-m", "blockdraft", "serve", "--method", "ar", "--port", str(s.port)],
            capture_output=True,
            timeout=300,
        )
        assert taken.returncode == 1 and b"address already in use" in taken.stderr, taken.stderr[-500:]
        holder = {}
        body = {"prompt": "Count from 1 to 1000, separated by commas: 1, 2, 3,", "max_tokens": 1500, "temperature": 0}
        w = threading.Thread(
            target=lambda: holder.setdefault("r", httpx.post(s.url + "/v1/completions", json=body, timeout=300))
        )
        w.start()
        time.sleep(2.0)
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        assert time.time() - t0 < 30, "the second signal waited for the grace period"
        w.join()
        r = holder["r"]
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text[:300]
        assert 0 < r.json()["usage"]["completion_tokens"] < 1500
        log = s.proc.stdout.read().decode(errors="replace")
        assert "Traceback" not in log, log
    finally:
        s.stop()


def serve_in_process(sched, rows, timeout: float, stagger: float = 0.0):
    """Start the scheduler's thread, submit `rows` (the i-th after i * stagger more seconds),
    wait until all are done or `timeout` passes, shut it down; returns the handles."""
    sched.start()
    handles = []
    for i, row in enumerate(rows):
        handles.append(sched.submit(row, lambda h: None))
        time.sleep(stagger * i)
    deadline = time.time() + timeout
    while not all(h.done for h in handles) and time.time() < deadline:
        time.sleep(0.02)
    sched.shutdown(grace=5)
    return handles


def test_scheduler_rigged_perfect_drafter_continuous_batching(smol, tokenizer, random_drafter, chat_ids):
    """In process: requests joining a running batch at different steps, with a drafter
    rigged to propose the true continuation (whole blocks accepted) - same tokens."""
    from blockdraft.batcher import generate_steps
    from blockdraft.proposers import Proposer

    n = 20
    prompts = chat_ids[:6]
    truths = []
    for ids in prompts:
        states = []
        for _ in generate_steps(smol, Proposer(), [Request(ids, n, stop_token_ids=(2,))], 1, states):
            pass
        truths.append(states[0].output_ids)
    from blockdraft import methods

    engine = Engine(smol, tokenizer, random_drafter)

    class SlotRigged(RiggedProposer):  # truths follow the request each slot serves
        def propose(self, last_tokens, positions, n_, rows=slice(None), probs=False):
            which = [prompts.index(r.prompt_ids) if r is not None else None for r in sched.loop.requests]
            self.truths = [truths[i] if i is not None else [] for i in which]
            self.prompt_lens = [len(prompts[i]) if i is not None else 0 for i in which]
            return super().propose(last_tokens, positions, n_, rows, probs)

    methods.register(
        methods.Method("rigged", "a perfect drafter", lambda e, spec: SlotRigged(random_drafter, smol, [], []))
    )
    try:
        sched = Scheduler(engine, method="rigged", max_batch=3, max_queue=10, max_model_len=1024, block_size=8)
    finally:
        del methods.METHODS["rigged"]
    # (a loaded 2-core machine can be slow)
    handles = serve_in_process(sched, [engine.make_row(ids, n) for ids in prompts], timeout=600, stagger=0.05)
    assert all(h.done for h in handles), "requests still running after 10 minutes"
    for h, truth in zip(handles, truths, strict=False):
        assert h.state.output_ids == truth
        steps = h.state.accepted_per_step  # (accepted, drafted): whole blocks, but where the answer ended
        assert all(a == n for a, n in steps[:-1]) and len(steps) < len(truth) / 2, steps


def test_the_scheduler_serves_every_registered_method():
    """Every method of the registry (shipped drafters found by default) serves greedy answers
    equal to plain autoregressive decoding."""
    from blockdraft import methods

    engine = Engine.load()
    prompts = [engine.encode(p, chat=True) for p in ("Count to five.", "Name a colour.")]
    want = [engine.generate(p, method="ar", max_new_tokens=10).token_ids for p in prompts]
    for name in methods.names():
        sched = Scheduler(engine, method=name, max_batch=2, max_queue=4, max_model_len=512)
        handles = serve_in_process(sched, [engine.make_row(p, 10) for p in prompts], timeout=120)
        assert [h.state.output_ids for h in handles] == want, name


def test_a_burst_fills_the_free_batch_slots_before_the_waiting_queue(smol, tokenizer, chat_ids):
    """Admission: with nothing running, a burst of max_batch + max_queue requests is taken (the
    first max_batch join the batch at the next step), the next one gets QueueFull; requests
    beyond the queue are refused only once the batch is full."""
    from blockdraft.serve.scheduler import QueueFull

    engine = Engine(smol, tokenizer)
    sched = Scheduler(engine, method="ar", max_batch=4, max_queue=2)  # not started: nothing is admitted yet
    ids = chat_ids[0]
    for _ in range(6):
        sched.submit(engine.make_row(ids, 4), lambda h: None)
    with pytest.raises(QueueFull):
        sched.submit(engine.make_row(ids, 4), lambda h: None)


def test_client_disconnects_are_counted_as_499_and_the_server_goes_on(server, engine):
    """A client that sends half a body and leaves, and one that leaves while its request runs:
    both are counted (status 499 in /metrics), neither disturbs the next request."""
    import socket
    from urllib.parse import urlparse

    def count():
        text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return sum(float(v) for v in re.findall(r'requests_total\{[^}]*status="499"[^}]*\} ([0-9.e+]+)', text))

    before = count()
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as s:  # half a body, then gone
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"prompt": '
        )
        time.sleep(0.5)
    with pytest.raises(httpx.TimeoutException):  # gone while it runs
        # the client gives up 50 ms into the request: its 32 tokens take longer than that on any step
        post_body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0}
        httpx.post(
            server.url + "/v1/completions",
            json=post_body,
            timeout=httpx.Timeout(10.0, read=0.05),
            headers={"Authorization": f"Bearer {KEY}"},
        )
    deadline = time.time() + 30
    while count() < before + 2 and time.time() < deadline:
        time.sleep(0.5)
    assert count() == before + 2
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(engine, "Hello", chat=False, n=8).text


def test_streams_longer_than_the_shutdown_grace_still_end_with_a_finish_reason_and_done():
    """SIGTERM with streams that need longer than --shutdown-grace: the scheduler's drain decides
    (it starts at the signal), every stream ends with a finish reason and [DONE], no traceback."""
    s = ServerProcess("--method", "ar", "--max-batch", "4", "--max-tokens", "1000", "--shutdown-grace", "2")
    try:
        out = {}

        def stream(i):
            lines = []
            body = {
                "prompt": f"Count from {i} to 1000, separated by commas:",
                "max_tokens": 1000,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
            out[i] = lines

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(3.0)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        for i in range(3):
            lines = out[i]
            assert lines[-1] == "[DONE]", lines[-3:]
            finishes = [c.get("finish_reason") for x in lines[:-1] for c in json.loads(x).get("choices", [])]
            assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1]), finishes[-3:]
        assert s.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = s.proc.stdout.read().decode(errors="replace")
        assert "Traceback" not in log, log[-2000:]
    finally:
        s.stop()


def test_a_slow_body_times_out_with_a_json_408():
    """--body-timeout: a client that stops sending its body gets a 408 in the OpenAI error shape
    (the connection and its task are not held forever)."""
    import socket
    from urllib.parse import urlparse

    with ServerProcess("--method", "ar", "--max-tokens", "8", "--body-timeout", "1") as s:
        url = urlparse(s.url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": '
            )
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                piece = sock.recv(4096)
                if not piece:
                    break
                reply += piece
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(body)["error"]["message"].startswith("the request body did not arrive")


def test_a_row_whose_sampling_fails_is_stopped_alone_and_the_batch_goes_on(smol, tokenizer, chat_ids):
    """Per-row fault isolation: a request whose own sampling raises (parameters that slipped past
    the API's checks) ends with an error for that request alone, at its first token and mid-way;
    the rows beside it give exactly their greedy answers."""
    from blockdraft.batcher import generate_steps
    from blockdraft.proposers import Proposer

    n = 12
    engine = Engine(smol, tokenizer)
    sched = Scheduler(engine, method="ar", max_batch=4, max_queue=10, max_model_len=1024)
    truths = []
    for ids in chat_ids[:2]:
        states = []
        for _ in generate_steps(smol, Proposer(), [Request(ids, n, stop_token_ids=(2,))], 1, states):
            pass
        truths.append(states[0].output_ids)
    sched.start()
    good = [sched.submit(engine.make_row(ids, n), lambda h: None) for ids in chat_ids[:2]]
    bad_row = engine.make_row(chat_ids[2], n, temperature=1.0, seed=1)
    bad_row.request.sampling.top_k = 2**64  # past every check: its sampling raises in the batch
    bad = sched.submit(bad_row, lambda h: None)
    deadline = time.time() + 600
    while not (all(h.done for h in good) and bad.done) and time.time() < deadline:
        time.sleep(0.05)
    sched.shutdown(grace=5)
    assert bad.done and bad.error and "failed" in bad.error and bad.error_status == 400
    for h, truth in zip(good, truths, strict=False):
        assert h.error is None and h.state.output_ids == truth


def test_requests_past_the_connection_cap_get_a_json_503_and_the_server_goes_on():
    """--max-connections N: with N requests in hand (here two bodies half sent), the next request
    gets a 503 in the OpenAI error shape with Retry-After, /health still answers, and once those
    requests end a new one is served."""
    import socket
    from urllib.parse import urlparse

    with ServerProcess("--method", "ar", "--max-tokens", "4", "--max-connections", "2", "--body-timeout", "3") as s:
        url = urlparse(s.url)
        held = []
        for _ in range(2):
            sock = socket.create_connection((url.hostname, url.port), timeout=30)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": '
            )
            held.append(sock)
        time.sleep(0.5)
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        for sock in held:  # each times out with its 408 (the body never completes)
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")
            sock.close()
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_the_metrics_position_rate_is_the_benchmarks_conditional_one():
    """/metrics' per-position acceptance rate is P(draft k accepted | drafts 1..k-1 accepted), the
    benchmark's definition (`costs.PositionAcceptance`), not accepted / drafted at k."""
    from blockdraft.serve.metrics import Metrics

    metrics = Metrics(max_block=4)
    metrics.observe_step(2, 4, [(0, 3), (3, 3)])  # one row rejects the first draft, one accepts all three
    metrics.observe_step(1, 4, [(1, 3)])
    text = metrics.render().decode()
    rates = {
        int(k): float(v) for k, v in re.findall(r'spec_position_acceptance_rate\{position="(\d)"\} ([0-9.]+)', text)
    }
    assert rates == {1: 2 / 3, 2: 1 / 2, 3: 1.0}  # position 2 reached twice (accepted once), 3 once
    drafted = re.findall(r'spec_drafted_tokens_total\{position="(\d)"\} ([0-9.]+)', text)
    assert {int(k): float(v) for k, v in drafted} == {1: 3.0, 2: 3.0, 3: 3.0}  # the raw counters stay counts
