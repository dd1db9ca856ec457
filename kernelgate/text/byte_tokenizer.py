"""The built-in model's tokenizer: bytes as tokens, a few special tokens, a ChatML template.

    ids 0..255    one UTF-8 byte each
    256           <|endoftext|>   (EOS)
    257           <|im_start|>
    258           <|im_end|>      (EOS: ends an assistant turn)
    259..V-1      <|reserved_N|>  (unused; the random built-in model still samples them)

It answers the part of the HF tokenizer API that kernelgate uses (`encode`, `decode`,
`apply_chat_template`, `eos_token_id`, `all_special_ids`), so the server, `run` and
`generate()` treat it and a checkpoint's tokenizer alike. Special-token text in a prompt
becomes the special token, as HF tokenizers do.
"""
from __future__ import annotations

import re

from ..errors import KernelgateError

NAMED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class ByteTokenizer:
    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + len(NAMED):
            raise KernelgateError(f"ByteTokenizer: vocab_size {vocab_size} < {256 + len(NAMED)} "
                                  "(256 bytes + the special tokens)")
        self.vocab_size = vocab_size
        self.special = {256 + i: name for i, name in enumerate(NAMED)}
        self.special.update({i: f"<|reserved_{i}|>" for i in range(256 + len(NAMED), vocab_size)})
        self._ids = {name: i for i, name in self.special.items()}
        self._split = re.compile("(" + "|".join(re.escape(n) for n in NAMED) + ")")
        self.eos_token_id = 256
        self.eos_token_ids = [256, 258]
        self.all_special_ids = sorted(self.special)
        self.chat_template = "chatml"    # rendered in Python below; a non-empty value says "has one"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text -> ids; special-token names in the text become their ids (no BOS is added)."""
        if not isinstance(text, str):
            raise KernelgateError(f"ByteTokenizer.encode: text must be a str, got {type(text).__name__}")
        out = []
        for part in self._split.split(text):
            if part in self._ids:
                out.append(self._ids[part])
            elif part:
                out.extend(part.encode("utf-8"))
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """ids -> text; bytes that are not valid UTF-8 (so far) decode to U+FFFD."""
        buf, parts = bytearray(), []
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if not 0 <= i < self.vocab_size:
                raise KernelgateError(f"ByteTokenizer.decode: id {i} outside [0, {self.vocab_size})")
            if not skip_special_tokens:
                parts.append(buf.decode("utf-8", errors="replace"))
                parts.append(self.special[i])
                buf = bytearray()
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: list, tokenize: bool = False, add_generation_prompt: bool = True):
        """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the assistant's
        opening when add_generation_prompt."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text
