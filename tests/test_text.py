"""Incremental detokenization and stop strings: equal to decoding everything, in O(length)."""

import pytest

from blockdraft.text import TextStream


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kw)


TEXTS = [
    "Héllo wörld! 😀 日本語のテキスト, ümlauts and emoji 🎉🎉 in one line.\nNext line: café.",
    "def f(x):\n    return x ** 2  # squares\n\nprint(f(3))",
    "Plain ASCII text with several words, punctuation; and numbers 12345 and 3.14159.",
]


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_fed_token_by_token_add_up_to_the_full_decode(tokenizer, text):
    ids = tokenizer(text).input_ids + [2]  # and a special token, skipped like the full decode skips it
    stream, pieces = TextStream(tokenizer), []
    grown: list[int] = []
    for t in ids:
        grown.append(t)
        stream.feed(grown)
        pieces.append(stream.delta(finished=False))
    stream.feed(grown, final=True)
    pieces.append(stream.delta(finished=True))
    assert "".join(pieces) == decode(tokenizer, ids) == stream.final_text
    assert all("\ufffd" not in p for p in pieces)  # incomplete characters are held back, not shown


def test_an_output_cut_inside_a_character_ends_like_the_full_decode(tokenizer):
    ids = tokenizer("日本").input_ids
    ids = next(ids[:k] for k in range(1, len(ids) + 1) if decode(tokenizer, ids[:k]).endswith("\ufffd"))
    stream = TextStream(tokenizer)
    stream.feed(ids)
    assert stream.delta(finished=False) == decode(tokenizer, ids).rstrip("\ufffd")
    stream.feed(ids, final=True)
    assert stream.final_text == decode(tokenizer, ids)


def brute_force_keep(tok, ids, stops):
    """The old rule: the shortest prefix of ids whose text contains a stop string."""
    for k in range(1, len(ids) + 1):
        if any(s in decode(tok, ids[:k]) for s in stops):
            return k
    return None


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_cut_where_decoding_everything_would(tokenizer, text):
    ids = tokenizer(text).input_ids
    full = decode(tokenizer, ids)
    for stops in ([full[10:14]], [full[25:27], full[5:6]], ["\n"], [full[-3:]], ["never occurs ~~"]):
        stream, grown, keep = TextStream(tokenizer, stops), [], None
        for t in ids:
            grown.append(t)
            stream.feed(grown)
            if stream.stop_keep is not None:
                keep = stream.stop_keep
                break
        assert keep == brute_force_keep(tokenizer, ids, stops), stops
        cuts = [full.find(s) for s in stops if s in full]
        assert stream.final_text == (full[: min(cuts)] if cuts else full)


def test_streaming_with_stop_strings_decodes_each_token_a_bounded_number_of_times(tokenizer):
    ids = tokenizer(" ".join(TEXTS) * 8).input_ids  # ~700 tokens
    counting = CountingTokenizer(tokenizer)
    stream, grown = TextStream(counting, ["never occurs ~~", "nor this"]), []
    for t in ids:
        grown.append(t)
        stream.feed(grown)
        stream.delta(finished=False)
    assert stream.text == decode(tokenizer, ids)
    assert counting.decoded < 12 * len(ids)  # O(length); decoding everything each step is ~length^2 / 2


def test_held_back_text_that_may_start_a_stop_string(tokenizer):
    stream = TextStream(tokenizer, ["STOP"])
    ids = tokenizer("go on ST").input_ids
    stream.feed(ids)
    assert stream.delta(finished=False) == "go on "  # "ST" may become "STOP"
    more = ids + tokenizer("ART").input_ids
    stream.feed(more)
    assert stream.delta(finished=False) == "START"
