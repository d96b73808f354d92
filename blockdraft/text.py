"""Incremental detokenization and stop strings, shared by the engine and the server.

Decoding a whole output after every step costs O(L) per step, O(L^2) per answer. A
`TextStream` decodes only a short window of the newest tokens (a few tokens before the
new ones, so that byte-level and SentencePiece merges come out right), appends the new
characters, and searches stop strings only where new text could complete one. A piece
ending in an incomplete UTF-8 character is held back until its next token arrives.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer, self.stops = tokenizer, list(stops or [])
        self.ids: list[int] = []
        self.text = ""  # text of ids[:read]
        self.prefix = self.read = 0  # window start (context for the decoder) and end of decoded ids
        self.stop_at: int | None = None  # char index where the first stop string starts
        self.stop_keep: int | None = None  # shortest number of ids whose text holds that stop string
        self.sent = 0  # chars handed out by `delta`

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def feed(self, ids: list[int], final: bool = False):
        """Catch up with a row's output ids (the same list, grown). With `final`, an
        incomplete trailing character is decoded as is, as a full decode would. Once a stop
        string has appeared the text is settled and later calls change nothing."""
        if self.stop_at is not None:
            return
        self.ids = ids  # the caller's list, read-only here (no copy: O(1) per step)
        while self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix : self.read])
            window = self._decode(self.ids[self.prefix :])
            if window.endswith(REPLACEMENT) and not final:
                return  # an incomplete character: wait for the next token
            start, first = len(self.text), self.read
            self.text += window[len(before) :]
            self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
            self._find_stop(start, first)

    def _find_stop(self, start: int, first: int):
        """Look for a stop string ending in the text added from char `start`, which came
        from ids[first:read]."""
        if not self.stops:
            return
        lo = max(0, start - max(len(s) for s in self.stops) + 1)
        hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
        if not hits:
            return
        self.stop_at = min(hits)
        self.stop_keep = self.read  # the shortest prefix of ids whose text holds a stop string
        for k in range(first + 1, self.read):
            if any(s in self._decode(self.ids[:k]) for s in self.stops):
                self.stop_keep = k
                break

    @property
    def final_text(self) -> str:
        """The text so far, cut before the first stop string."""
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def delta(self, finished: bool) -> str:
        """New text since the last call. While the row runs, text that may still turn out
        to start a stop string is held back."""
        text = self.final_text
        if not finished and self.stop_at is None:
            for s in self.stops:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        text = text[:-k]
                        break
        if len(text) <= self.sent:
            return ""
        out, self.sent = text[self.sent :], len(text)
        return out


def chat_prompt_ids(tokenizer, turns: list[dict] | str) -> list[int]:
    """Token ids of a conversation (or one user turn) in the chat template, ready for the answer."""
    messages = [{"role": "user", "content": turns}] if isinstance(turns, str) else turns
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
