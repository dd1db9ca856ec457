"""Incremental detokenization (never half a character) and stop strings (cut exactly, even
across tokens), with the built-in byte tokenizer and a checkpoint-style (HF) tokenizer."""
import pytest

from kernelgate.text.detokenizer import Detokenizer
from kernelgate.text.byte_tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def feed(detok, ids, step=1):
    parts = [detok.update(ids[i:i + step]) for i in range(0, len(ids), step)]
    return parts, parts + [detok.finish()]


def test_byte_tokenizer_round_trip_specials_and_template():
    text = "héllo ✓ 🙂<|im_end|>x"
    ids = TOK.encode(text)
    assert ids[-2:] == [258, ord("x")] and len(ids) == len("héllo ✓ 🙂".encode()) + 2
    assert TOK.decode(ids) == text
    assert TOK.decode(ids, skip_special_tokens=True) == "héllo ✓ 🙂x"
    assert TOK.decode([300, 65], skip_special_tokens=False) == "<|reserved_300|>A"
    chat = TOK.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert TOK.encode(chat)[:1] == [257]


def test_multibyte_characters_never_split():
    text = "a€b🙂c"               # 1, 3, 1, 4, 1 bytes
    ids = TOK.encode(text)
    parts, all_parts = feed(Detokenizer(TOK), ids)
    assert "".join(all_parts) == text
    assert all("\ufffd" not in p for p in parts)
    # the euro sign appears whole, on its third byte
    assert parts[:4] == ["a", "", "", "€"]


def test_invalid_bytes_are_flushed_at_the_end():
    ids = [ord("x"), 0xE2, 0x82]          # a truncated 3-byte character
    parts, all_parts = feed(Detokenizer(TOK), ids)
    assert parts == ["x", "", ""] and all_parts[-1] == "\ufffd"
    assert "".join(all_parts) == TOK.decode(ids)


def test_special_tokens_skipped_between_bytes():
    ids = [0xC3, 300, 0xA9, 256, ord("!")]
    parts, all_parts = feed(Detokenizer(TOK), ids)
    assert "".join(all_parts) == "é!" == TOK.decode(ids, skip_special_tokens=True)
    parts, all_parts = feed(Detokenizer(TOK, skip_special_tokens=False), [65, 256, 66])
    assert "".join(all_parts) == "A<|endoftext|>B"


@pytest.mark.parametrize("step", [1, 2, 5], ids=lambda s: f"step{s}")
def test_stop_string_spanning_tokens_is_cut_exactly(step):
    ids = TOK.encode("hello wor€ld, more")
    d = Detokenizer(TOK, stop=["€l", "zzz"])
    parts, all_parts = feed(d, ids, step)
    assert "".join(all_parts) == "hello wor" and d.stopped == "€l"
    # nothing after the stop is ever handed out, even text that arrived with it
    assert d.update(TOK.encode("more")) == ""


def test_stop_prefix_is_held_back_then_released():
    d = Detokenizer(TOK, stop=["abc"])
    assert d.update(TOK.encode("xa")) == "x"        # "a" might start "abc"
    assert d.update(TOK.encode("b")) == ""
    assert d.update(TOK.encode("d")) == "abd"       # it did not
    assert d.update(TOK.encode("ab")) == "" and d.finish() == "ab" and d.stopped is None


def test_earliest_stop_wins():
    d = Detokenizer(TOK, stop=["cd", "bcde"])
    text = "".join(feed(d, TOK.encode("abcdef"), step=6)[1])
    assert text == "a" and d.stopped == "bcde"


def test_hf_tokenizer_window_matches_full_decode():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁": 3, "é": 4, "!": 5, "<0xE2>": 6, "<0x82>": 7, "<0xAC>": 8}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    ids = [1, 2, 3, 6, 7, 8, 5, 2]
    parts, all_parts = feed(Detokenizer(hf), ids)
    assert "".join(all_parts) == hf.decode(ids) == "hello world €! world"
    assert all("\ufffd" not in p for p in parts)
