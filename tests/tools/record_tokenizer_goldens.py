"""Record tokenizer goldens from llama.cpp (through llama-cpp-python) for
tests/engine/test_tokenizer.py.

Run with a Python that has `llama_cpp` (this script must not import localllm):

    /root/refvenv/bin/python tests/tools/record_tokenizer_goldens.py \
        smollm2=/path/SmolLM2-135M-Instruct.Q4_1.gguf gemma3=/path/gemma-3-270m-it-Q4_K_M.gguf

For each NAME=PATH it loads the vocabulary only (`vocab_only=True`) and writes
tests/data/tokenizer/NAME.json with, for every corpus string, the token ids for add_special x
parse_special, llama_detokenize of the ids both ways, the pieces of a sample of token ids, and the
end-of-generation ids. Byte strings are stored as hex since they need not be UTF-8.

`vocab-gguf SRC DST` (run with a Python that has the `gguf` package) copies all metadata of SRC into
a tensor-less GGUF at DST: enough for llama.cpp's vocab_only load, for files whose tensor data is
missing (a truncated first slice of a split model still has the whole tokenizer).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"

CORPUS = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n\n",
    "Hello world",
    " Hello world",
    "Hello world ",
    "   leading and trailing   ",
    "The quick brown fox jumps over the lazy dog.",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? "
    "We'Ve a'lL",
    "def f(x):\n    if x > 0:\n\treturn x ** 2  # square\n    return -x\n",
    "class A {\n  public static void main(String[] args) {\n"
    '    System.out.println("hi");\n  }\n}\n',
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3",
    "1234567890123456789012345678901234567890 and 007",
    "Pi is 3.14159265358979323846264338327950288419716939937510",
    "我想在apple工作1314151天～",
    "こんにちは、世界！カタカナとひらがな。",
    "안녕하세요 세계",
    "مرحبا بالعالم! كيف حالك؟",
    "שלום עולם hello",
    "e\u0301 n\u0303 a\u0308\u0304 Cửa Việt Z\u0351\u0352a\u0354l\u0355g\u0356o",
    "नमस्ते दुनिया",
    "កាន់តែពិសេសអាច😁",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 skin tone, 🇯🇵 flags",
    "a" + " " * 40 + "b" + "\n" * 5 + "c\t\t\td",
    "     \n\n   \t\t\n  x  \n",
    "\r\n windows \r\n line endings\r\n",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>Hello<eos> <s>x</s> <unk> <pad>",
    "<|im_start |> <| im_end|> <im_start> <start_of_turn <end_of_turn>> <<bos>>",
    "<|endoftext|><|endoftext|>",
    "<b>bold</b> <h1>Title</h1> <table><tr><td>1</td></tr></table>",
    "<unused0><unused99> [multimodal] <mask> <repo_name>x<file_sep>",
    "Special <|im_start|>in the middle<|im_end|> of text",
    "''''''```````\"\"\"\"......!!!!!!?????? ------======= ~~~~ ||||",
    "нещо на Български Ελληνικά Ünïcödé çà et là — “quotes” ‘single’ …",
    "https://example.com/path?q=1&r=2#frag user@example.org",
    '{"name": "x", "list": [1, 2, 3], "nested": {"a": null}}',
    "∑_{i=1}^{n} x_i² ≤ ∞ ∀ε>0 ∃δ",
    "\x00\x01\x7f control chars \u200b zero-width \ufeff BOM",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ　１２３ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    (
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
        "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was "
        "the "
        "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
        "winter of despair, we had everything before us, we had nothing before us, we were all "
        "going direct to Heaven, we were all going direct the other way."
    ),
]


def _detokenize(llama_cpp, vocab, ids: list[int], remove_special: bool, unparse: bool) -> bytes:
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n]


def _piece(llama_cpp, vocab, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


def record(name: str, path: str) -> Path:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()
    cases = []
    used: set[int] = set()
    for text in CORPUS:
        raw = text.encode("utf-8")
        ids = {}
        for add in (True, False):
            for special in (True, False):
                toks = llm.tokenize(raw, add_bos=add, special=special)
                ids[f"add{int(add)}_special{int(special)}"] = toks
                used.update(toks)
        full = ids["add1_special1"]
        cases.append(
            {
                "text": text,
                "ids": ids,
                # our decode(skip_special=False) / decode(skip_special=True)
                "decode_keep": _detokenize(llama_cpp, vocab, full, False, True).hex(),
                "decode_skip": _detokenize(llama_cpp, vocab, full, True, False).hex(),
            }
        )
    sample = set(range(min(n_vocab, 300))) | set(range(0, n_vocab, max(1, n_vocab // 300)))
    sample |= used
    pieces = {str(i): _piece(llama_cpp, vocab, i, True).hex() for i in sorted(sample)}
    hidden = [
        i
        for i in sorted(sample)
        if not _piece(llama_cpp, vocab, i, False) and _piece(llama_cpp, vocab, i, True)
    ]
    eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    golden = {
        "source": f"llama-cpp-python {llama_cpp.__version__}, vocab_only, {Path(path).name}",
        "n_vocab": n_vocab,
        "bos": llm.token_bos(),
        "eos": llm.token_eos(),
        "eog": eog,
        "hidden_in_sample": hidden,
        "pieces": pieces,
        "cases": cases,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"{name}.json"
    lines = ["{"]
    head = {k: v for k, v in golden.items() if k != "cases"}
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)},")
    lines.append('  "cases": [')
    lines.append(",\n".join("    " + json.dumps(c, ensure_ascii=False) for c in cases))
    lines.append("  ]")
    lines.append("}")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def vocab_gguf(src: str, dst: str) -> None:
    """Copy every metadata key of `src` into a GGUF without tensors."""
    import gguf
    import numpy as np

    # A truncated file (first slice of a split model) has all metadata but not the tensor data the
    # reader checks: read a copy whose header says there are no tensors.
    data = bytearray(Path(src).read_bytes())
    data[8:16] = (0).to_bytes(8, "little")  # GGUF v2/v3: magic, version, then the tensor count
    tmp = Path(dst).with_suffix(".header.tmp")
    tmp.write_bytes(data)
    reader = gguf.GGUFReader(tmp)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = np.concatenate([field.parts[i] for i in field.data]).tolist()
            writer.add_key_value(field.name, value, kind, sub_type=sub)
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.unlink()


def main(argv: list[str]) -> None:
    if argv[:1] == ["vocab-gguf"]:
        vocab_gguf(argv[1], argv[2])
        return
    for arg in argv:
        name, _, path = arg.partition("=")
        print(record(name, path))


if __name__ == "__main__":
    main(sys.argv[1:])
