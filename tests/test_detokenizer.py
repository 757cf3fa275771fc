"""IncrementalDetokenizer against the default model's real byte-level BPE tokenizer."""
from __future__ import annotations

import itertools
import random

import pytest

from common.detokenizer import IncrementalDetokenizer, token_texts
from common.model_source import ModelSource

pytestmark = pytest.mark.unit

IM_END = 2  # <|im_end|> in the default model's vocabulary

ENGLISH = "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?"
CHINESE = "你好，世界！今天天气很好。"
EMOJI = "🙂👍🏽🎉 family: 👨‍👩‍👧"
MIXED = "Price: 5€ — 价格很便宜 🎉! naïve café, Ελληνικά, русский.\n\tEnd"
TEXTS = {"english": ENGLISH, "chinese": CHINESE, "emoji": EMOJI, "mixed": MIXED}


@pytest.fixture(scope="module")
def tok():
    return ModelSource.resolve(None).load_tokenizer()


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into consecutive chunks whose sizes cycle through `sizes`."""
    out, i = [], 0
    for n in itertools.cycle(sizes):
        if i >= len(ids):
            return out
        out.append(ids[i:i + n])
        i += n


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    """All deltas, finish() last."""
    return [detok.update(c) for c in chunks] + [detok.finish()]


CHUNKINGS = {"token_by_token": [1], "uneven": [3, 1, 2, 5, 1], "all_at_once": [10_000]}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("name", TEXTS)
def test_deltas_join_to_full_decode(tok, name, chunking):
    ids = enc(tok, TEXTS[name])
    detok = IncrementalDetokenizer(tok, enc(tok, "<|im_start|>assistant\n"))
    deltas = stream(detok, chunked(ids, CHUNKINGS[chunking]))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == TEXTS[name]
    assert detok.output_text == TEXTS[name]
    assert detok.stop_reason is None
    assert not any("\ufffd" in d for d in deltas)


def test_multi_token_characters_are_held_until_complete(tok):
    ids = enc(tok, EMOJI)
    # The tokenizer really does split these characters over several tokens ...
    assert any("\ufffd" in t for t in token_texts(tok, ids))
    detok = IncrementalDetokenizer(tok, [])
    emitted = ""
    for i in ids:
        emitted += detok.update([i])
        # ... yet what has been emitted is always a clean prefix of the text.
        assert EMOJI.startswith(emitted)
    assert detok.finish() == ""
    assert emitted == EMOJI


def test_prompt_ending_mid_character_does_not_shift_output(tok):
    ids = enc(tok, CHINESE)
    prompt, generated = ids[:1], ids[1:]  # the first token holds only part of 你
    assert tok.decode(prompt).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, prompt)
    joined = "".join(stream(detok, chunked(generated, [1])))
    assert joined == tok.decode(generated, skip_special_tokens=True)


def test_window_stays_short(tok):
    """Each step decodes a few trailing tokens, not the whole sequence."""
    lengths: list[int] = []

    class Recording:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tok.decode(ids, **kw)

    ids = enc(tok, " ".join([ENGLISH, CHINESE, EMOJI] * 10))
    detok = IncrementalDetokenizer(Recording(), enc(tok, ENGLISH))
    assert "".join(stream(detok, chunked(ids, [1]))) == tok.decode(ids)
    assert len(ids) > 300 and max(lengths) <= 10


def test_stop_string_spanning_tokens_never_leaks(tok):
    text = "The answer is 42. END_OF_ANSWER and then more text"
    stop = "END_OF_ANSWER"
    ids = enc(tok, text)
    assert sum(t in stop for t in token_texts(tok, ids)) >= 3  # the stop string spans several tokens
    expected = text[:text.index(stop)]
    for sizes in CHUNKINGS.values():
        detok = IncrementalDetokenizer(tok, [], stop=[stop])
        emitted = ""
        for chunk in chunked(ids, sizes):
            emitted += detok.update(chunk)
            assert expected.startswith(emitted)  # nothing past the stop string's start, ever
        assert detok.finish() == ""
        assert emitted == detok.output_text == expected
        assert detok.stop_reason == stop
        assert detok.update(enc(tok, " more")) == ""
        assert detok.output_text == expected


def test_stop_string_inside_multi_byte_characters(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["天气"])
    deltas = stream(detok, chunked(enc(tok, CHINESE), [1]))
    assert "".join(deltas) == detok.output_text == "你好，世界！今天"
    assert detok.stop_reason == "天气"


def test_include_stop_str_in_output(tok):
    text = "Answer: yes</answer> trailing"
    for sizes in CHUNKINGS.values():
        detok = IncrementalDetokenizer(tok, [], stop=["</answer>"], include_stop_str_in_output=True)
        assert "".join(stream(detok, chunked(enc(tok, text), sizes))) == "Answer: yes</answer>"
        assert detok.stop_reason == "</answer>"


def test_earliest_stop_wins(tok):
    ids = enc(tok, "alpha beta gamma delta")
    for sizes in CHUNKINGS.values():
        detok = IncrementalDetokenizer(tok, [], stop=["delta", "beta", "gamma"])
        assert "".join(stream(detok, chunked(ids, sizes))) == "alpha "
        assert detok.stop_reason == "beta"


def test_first_completed_stop_wins_regardless_of_chunking(tok):
    """"cd" completes before "abcdef" does, so it wins even when both arrive in one update."""
    ids = enc(tok, "say abcdef now")
    for sizes in CHUNKINGS.values():
        detok = IncrementalDetokenizer(tok, [], stop=["abcdef", "cd"])
        assert "".join(stream(detok, chunked(ids, sizes))) == "say ab"
        assert detok.stop_reason == "cd"


def test_partial_stop_match_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["END_OF"])
    first = detok.update(enc(tok, "The END"))
    assert first == "The "  # "END" may still become "END_OF"
    second = detok.update(enc(tok, " is near"))
    assert first + second == "The END is near"
    assert detok.finish() == ""
    assert detok.stop_reason is None


def test_finish_flushes_held_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.update(enc(tok, "Hello ST")) == "Hello "
    assert detok.finish() == "ST"
    assert detok.output_text == "Hello ST"
    assert detok.stop_reason is None
    assert detok.update(enc(tok, "OP")) == ""


def test_finish_flushes_incomplete_character(tok):
    ids = enc(tok, EMOJI)[:1]  # the first bytes of 🙂 only
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update(ids) == ""
    assert detok.finish() == tok.decode(ids) == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = enc(tok, "Hi there") + [IM_END] + enc(tok, " 你好") + [IM_END]
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert expected == ("Hi there 你好" if skip else "Hi there<|im_end|> 你好<|im_end|>")
    for sizes in CHUNKINGS.values():
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(stream(detok, chunked(ids, sizes))) == expected


def test_special_token_as_stop_string(tok):
    ids = enc(tok, "Done.") + [IM_END] + enc(tok, "junk")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert "".join(stream(detok, chunked(ids, [1]))) == "Done."
    assert detok.stop_reason == "<|im_end|>"


def test_token_texts(tok):
    ids = enc(tok, "Hello world") + [IM_END]
    assert token_texts(tok, ids) == ["Hello", " world", "<|im_end|>"]


def test_random_token_streams_match_full_decode(tok):
    """Random ids, biased to partial-character tokens, give invalid and interrupted UTF-8 too."""
    rng = random.Random(0)
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    for _ in range(100):
        ids = [rng.choice(partial) if rng.random() < 0.6 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        skip = rng.random() < 0.5
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        joined = "".join(stream(detok, chunked(ids, [rng.randrange(1, 4) for _ in range(5)])))
        assert joined == tok.decode(ids, skip_special_tokens=skip)
