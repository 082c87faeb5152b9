"""Tiny real tokenizers for the converted-family fixtures (`record_family_fixtures.py`).

Two kinds, each the kind its family ships, trained on a few lines of text so the vocabulary stays
small (~150 tokens, the fixtures tens of KB):
- byte-level BPE with the Llama 3 split regex (SmolLM3, GLM-4.5, OLMo 2 use this shape): the byte
  symbols the text uses, merges up to `vocab_size`, then the family's added tokens;
- a SentencePiece BPE model (Gemma 2), with Gemma's control tokens at Gemma's ids.
Both cover printable ASCII and newlines only (no byte fallback: that would take 256 tokens).

Never imports localllm; runs with tokenizers, sentencepiece and transformers.
"""

from __future__ import annotations

from pathlib import Path

# The pre-tokenizer of Llama 3 (llama.cpp's `llama-bpe`), also GLM-4's and cl100k's (`dbrx`).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small cat who liked to sit on the warm mat.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "What is the weather in Paris today? It is sunny and warm.",
    "The user asked the assistant a question, and the assistant answered with a tool call.",
    "Numbers: 1 2 3 10 42 100 2024. Lists, commas; quotes 'single' and \"double\".",
    "city location unit celsius fahrenheit get_weather search query result",
    "".join(map(chr, range(32, 127))) + "\n\t",  # every printable ASCII character, once
]


def byte_bpe(out: Path, vocab_size: int, added: list[tuple[str, bool]], **special) -> Path:
    """A byte-level BPE tokenizer saved in `out` (tokenizer.json + tokenizer_config.json).

    `added`: (text, special) tokens appended after the merges, in order; `special`: the
    PreTrainedTokenizerFast keywords (bos_token=..., chat_template=..., ...)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.save_pretrained(out)
    # said outright, as the real checkpoints do: llama.cpp's default for some pre-tokenizers
    # (llama-bpe) is to add a BOS, transformers' for this tokenizer is not to
    _update_config(out, {"add_bos_token": False, "add_eos_token": False})
    return out


def _update_config(out: Path, entries: dict) -> None:
    import json

    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, **entries}, indent=2), encoding="utf-8")


# Gemma's turn markers (user-defined pieces after the control tokens <pad> <eos> <bos> <unk>).
GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]


def gemma_spm(out: Path, vocab_size: int, chat_template: str) -> Path:
    """A SentencePiece BPE `tokenizer.model` with Gemma's special ids, and the transformers
    tokenizer files converted from it (as a Gemma checkpoint ships both), saved in `out`."""
    import io
    import json

    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=GEMMA_TURNS,
        normalization_rule_name="identity",  # as Gemma's: newlines and tabs stay pieces
        add_dummy_prefix=False,  # Gemma's tokenizer adds no leading space
        remove_extra_whitespaces=False,
        split_digits=True,
        byte_fallback=False,
        num_threads=1,
        minloglevel=2,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False}
    config |= {f"{k}_token": f"<{k}>" for k in ("bos", "eos", "unk", "pad")}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    fast = AutoTokenizer.from_pretrained(out)  # converted from the SentencePiece model
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    # Gemma's tokenizer_config lists its control tokens (the converter marks them CONTROL, so
    # the turn markers are single tokens in a template's text); transformers 5 writes no list
    names = ["<pad>", "<eos>", "<bos>", "<unk>", *GEMMA_TURNS]
    listed = {str(fast.convert_tokens_to_ids(t)): {"content": t, "special": True} for t in names}
    _update_config(out, {"added_tokens_decoder": listed})
    return out
