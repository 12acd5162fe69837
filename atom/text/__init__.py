"""Floor 1: text in, tokens out. `records` reads JSONL records and applies chat templates;
`tokenize` turns text into token ids (bytes, BPE)."""
