"""The engine's TokenLogprobs -> OpenAI logprobs objects.

/v1/completions (`logprobs: k`), per choice, in the legacy shape:
    {"tokens": [tok, ...], "token_logprobs": [lp, ...],
     "top_logprobs": [{tok: lp, ...}, ...],     # the sampled token first, then the k most likely
     "text_offset": [chars before tok, ...]}
/v1/chat/completions (`logprobs: true, top_logprobs: k`), per choice:
    {"content": [{"token": tok, "logprob": lp, "bytes": [...],
                  "top_logprobs": [{"token", "logprob", "bytes"} x k]}, ...], "refusal": null}

A token's text is its id decoded alone (special tokens included), as vLLM does; a byte that
is part of a multi-byte character then reads U+FFFD, so `return_tokens_as_token_ids` names
tokens "token_id:N" instead. text_offset counts the characters of those token texts, so in
a stream it continues where the previous chunk ended. A logprob below -9999 (a token the
model all but rules out) is reported as -9999.0, as vLLM does: JSON has no -inf.
"""
from __future__ import annotations

FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, FLOOR)


class LogprobsFormatter:
    def __init__(self, tokenizer, chat: bool, as_ids: bool):
        self.tok, self.chat = tokenizer, chat
        self.as_ids = as_ids or tokenizer is None
        self._text: dict = {}
        self._offset: dict = {}       # choice index -> characters of token text so far

    def token(self, t: int) -> str:
        if self.as_ids:
            return f"token_id:{t}"
        s = self._text.get(t)
        if s is None:
            s = self._text[t] = self.tok.decode([t], skip_special_tokens=False)
        return s

    def format(self, i: int, ids: list, entries: list | None) -> dict | None:
        """The logprobs object of choice i's tokens `ids` (a whole output, or one chunk's)."""
        if entries is None:
            return None
        return self._chat(ids, entries) if self.chat else self._completion(i, ids, entries)

    def _completion(self, i: int, ids: list, entries: list) -> dict:
        off = self._offset.get(i, 0)
        tokens, offsets, tops = [], [], []
        for t, e in zip(ids, entries):
            s = self.token(t)
            tokens.append(s)
            offsets.append(off)
            off += len(s)
            top = {s: _lp(e.logprob)}
            for a, v in e.top:
                top.setdefault(self.token(a), _lp(v))
            tops.append(top)
        self._offset[i] = off
        return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _entry(self, t: int, lp: float) -> dict:
        s = self.token(t)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8", errors="replace"))}

    def _chat(self, ids: list, entries: list) -> dict:
        content = [{**self._entry(t, e.logprob), "top_logprobs": [self._entry(a, v) for a, v in e.top]}
                   for t, e in zip(ids, entries)]
        return {"content": content, "refusal": None}
