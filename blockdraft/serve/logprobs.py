"""OpenAI's `logprobs` shapes from the decode loop's per-token scores (`SequenceState.logprobs`).

Chat completions: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
"refusal": null}`; legacy completions: `{tokens, token_logprobs, top_logprobs, text_offset}`. A
token's `bytes` are its raw bytes (a byte-level token may hold part of a UTF-8 character); its
`token` is their text, or, where they are not valid UTF-8, `bytes:\\xe2\\x80` as OpenAI writes it.
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token id's raw bytes and display text (cached; read on the event loop only)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.cache: dict[int, tuple[str, bytes]] = {}

    def _raw(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special:
            return piece.encode("utf-8")
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self.cache.get(token_id)
        if hit is None:
            raw = self._raw(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self.cache[token_id] = (text, raw)
        return hit


def chat_logprobs(texts: TokenTexts, ids: list[int], scores: list[tuple]) -> dict:
    """`choices[i].logprobs` of a chat completion (or chunk) for tokens `ids` and their scores."""

    def entry(token_id, logprob):
        text, raw = texts.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
            for t, (lp, top) in zip(ids, scores, strict=False)
        ],
        "refusal": None,
    }


class CompletionLogprobs:
    """`choices[i].logprobs` of a legacy completion, chunk by chunk: `text_offset` counts the
    characters of the generated text before each token (special tokens add none, as they are
    not in the text), carried across a stream's chunks."""

    def __init__(self, texts: TokenTexts):
        self.texts, self.chars = texts, 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, ids: list[int], scores: list[tuple]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, (logprob, top) in zip(ids, scores, strict=False):
            text, raw = self.texts.get(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            # the N most likely tokens, and the chosen one (OpenAI: up to logprobs + 1 entries)
            alternatives = {self.texts.get(i)[0]: v for i, v in top}
            alternatives.setdefault(text, logprob)
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self.chars)
            if token_id not in self.texts.special:
                self.chars += len(self.utf8.decode(raw))
        return out
