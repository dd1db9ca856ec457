"""Token ids in, text deltas out: incremental detokenization and stop strings.

Detokenizing a growing token list one token at a time goes wrong in two ways: a multi-byte
character split over tokens decodes to U+FFFD until its last byte arrives, and a tokenizer
may render a token differently depending on the one before it (SentencePiece's leading
space). So each update decodes a short window (the tokens emitted last time + the new
ones) and emits what the new tokens added, holding everything back while the text ends in
U+FFFD (vLLM and HF's TextStreamer do the same).

Stop strings can span tokens: the text that could still be the start of a stop string is
held back too, and when one appears the text is cut just before it (OpenAI's rule: the
stop string is not returned).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.prefix_offset = 0      # window start: tokens emitted by the previous update
        self.read_offset = 0        # tokens already turned into text
        self.text = ""              # all text decoded so far (before stop-string cuts)
        self.sent = 0               # characters of `text` handed out
        self.stopped: str | None = None   # the stop string that ended the output

    def _decode(self, ids) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT)):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def update(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that may be shown now ("" while holding back). Once a
        stop string appears, `stopped` is set and later calls return ""."""
        if self.stopped is not None:
            return ""
        self.ids.extend(new_ids)
        self._advance(final)
        if self.stop:
            # a stop string can only end inside the new text, so search from just before it
            longest = max(len(s) for s in self.stop)
            start = max(0, self.sent - longest + 1)
            hits = [(p, s) for s in self.stop if (p := self.text.find(s, start)) >= 0]
            if hits:
                pos, self.stopped = min(hits)
                self.text = self.text[:pos]
                return self._emit(len(self.text))
            if not final:
                return self._emit(len(self.text) - self._partial_stop())
        return self._emit(len(self.text))

    def _partial_stop(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        tail = self.text[self.sent:]
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out

    def finish(self) -> str:
        """The request ended: flush what was held back (a trailing U+FFFD included)."""
        return self.update([], final=True)
