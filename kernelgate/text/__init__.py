"""Text in and out: the built-in byte tokenizer and the incremental detokenizer (stop strings)."""
