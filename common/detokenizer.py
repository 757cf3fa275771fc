"""Incremental detokenization for streaming: UTF-8-safe text deltas with stop-string handling.

Decoding the whole generated sequence after every token costs O(n) per token, and decoding each
token alone is wrong: byte-level BPE splits one character (CJK, emoji) over several tokens, and
some decoders (SentencePiece/Metaspace) render a token differently at the start of a sequence.
So, like vLLM and TGI, we decode only a short trailing window of tokens twice — once up to the
"read offset" (text already produced) and once to the end — and take the difference. The window
moves forward whenever the newly decoded text ends on a complete character.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# U+FFFD is what decoding yields for an incomplete UTF-8 byte sequence at the end of the window.
_REPLACEMENT = "\ufffd"

# Prompt tokens used as left context for the first generated token. Enough for decoders whose
# output for a token depends on its neighbours (leading-space handling); byte-level BPE needs none.
_PROMPT_CONTEXT_TOKENS = 5


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own (special tokens kept), as logprobs report tokens.

    A token holding only part of a UTF-8 character decodes to U+FFFD here; that is inherent to
    showing tokens one at a time and matches what OpenAI-compatible servers return.
    """
    return tokenizer.batch_decode([[int(i)] for i in ids], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text deltas that are safe to stream.

    The deltas joined (update() results, then finish()) equal
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers
    (the default model, GPT-2/Llama-3/Qwen style) when no stop string matches. The first generated
    token is decoded after a few prompt tokens, so with SentencePiece/Metaspace tokenizers the
    first delta keeps a word-initial space that decoding the generated ids alone would strip, as
    in vLLM.

    Stop strings are matched against the decoded text. The match that completes first wins
    (on a tie, the one starting earlier), so the result does not depend on how tokens are
    grouped into update() calls. A tail of text that could still grow into a stop string is held
    back, so no part of a stop string is ever emitted unless include_stop_str_in_output is set.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in (stop or []) if s]  # an empty stop string would match before any text
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output

        context = [int(i) for i in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its bytes would merge with the first generated
            # ones and the difference against context_text would misalign, so start without context.
            context, context_text = [], ""
        # Decoding window: _window[:_read] has been turned into text (whose decode is _read_text);
        # _window[_read:] are tokens whose text is not yet complete.
        self._window = context
        self._read = len(context)
        self._read_text = context_text
        # Characters of the pending part of the window already appended to _text, for when the
        # window ends mid-character but complete characters precede it.
        self._pending_chars = 0

        self._text = ""  # all complete decoded text (cut at the stop string once one matches)
        self._sent = 0  # len of _text already returned to the caller
        self._scanned = 0  # len of _text already searched for stop strings
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        return self._text[:self._sent]

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, or None while none has matched."""
        return self._stop_reason

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Consume newly generated token ids; return the text delta that is now safe to emit.

        Returns "" once a stop string has matched or finish() was called.
        """
        if self._finished:
            return ""
        self._window.extend(int(i) for i in new_token_ids)
        self._text += self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: return the text still held back.

        Bytes that never completed a character come out as U+FFFD, as a full decode shows them.
        """
        if self._finished:
            return ""
        self._text += self._decode_new(final=True)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text the window adds that is complete now (or everything, when final)."""
        new = self._decode(self._window)[len(self._read_text):]
        if new.endswith(_REPLACEMENT) and not final:
            # The last bytes may still become a character with the next token: keep them and the
            # window, but hand out the complete characters before them.
            piece = new.rstrip(_REPLACEMENT)[self._pending_chars:]
            self._pending_chars += len(piece)
            return piece
        piece = new[self._pending_chars:]
        # Slide: the tokens just read become the left context of the next decode.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        self._pending_chars = 0
        return piece

    def _release(self, final: bool) -> str:
        """Return the next delta of _text: up to a stop string, or up to a tail that might start one."""
        if not self._stops:
            end = len(self._text)
        elif (match := self._find_stop()) is not None:
            stop, start = match
            end = start + len(stop) if self._include_stop else start
            self._text = self._text[:end]
            self._stop_reason = stop
            self._finished = True
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_tail_len()
        if final:
            self._finished = True
        delta = self._text[self._sent:end]
        self._sent = end
        return delta

    def _find_stop(self) -> tuple[str, int] | None:
        """The first-completing stop string in text not searched before, with its start index."""
        # A match ending in the new text starts at most max_stop_len - 1 characters before it.
        begin = max(0, self._scanned - self._max_stop_len + 1)
        self._scanned = len(self._text)
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = self._text.find(stop, begin)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[2], best[1])

    def _held_tail_len(self) -> int:
        """Length of the longest unsent tail of _text that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop_len - 1, len(self._text) - self._sent), 0, -1):
            tail = self._text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
