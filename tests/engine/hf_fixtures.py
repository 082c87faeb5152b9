"""Tiny random-weight Hugging Face folders of every family we map (`engine/hf`), made with
transformers' own classes and `save_pretrained` (bf16 weights, as most Hub checkpoints).

`save_tiny(family, folder)` writes config.json, model.safetensors, generation_config.json and a
tokenizer trained here on a fixed text (byte-level BPE, or a SentencePiece-style BPE with byte
fallback for gemma3) with ChatML special tokens and template. Seeds fix every weight; norms are
1 +- noise (Gemma: +-noise around 0, since it multiplies by 1 + w) so no layer is a no-op.
Used by tests/engine/test_hf_*.py and by tests/tools/record_hf_fixtures.py (which commits two
of them with their llama.cpp conversions). Imports no localllm module.
"""

import json
from pathlib import Path

import torch

SEED = 1234
VOCAB = 300  # 256 bytes + merges + 3 specials (the SentencePiece-style one has a few more)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, world! Hello there, how are you today?",
    "def main():\n    print('hello')\n    return 0\n",
    "Über café naïve — 東京 12345 67890 ++ -- == !!",
    "the cat sat on the mat and the dog sat on the log",
]
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
)


def config(family: str, vocab: int = VOCAB, width: int | None = None):
    import transformers as t

    c = {**COMMON, "vocab_size": vocab}
    if width is not None:  # wider than the default 32 (rows of whole 256-value K-quant blocks)
        c.update(hidden_size=width, intermediate_size=2 * width)
    if family == "llama":
        return t.LlamaConfig(**c, tie_word_embeddings=True, rope_theta=500000.0)
    if family == "mistral":
        return t.MistralConfig(**c, tie_word_embeddings=False, sliding_window=None)
    if family == "qwen2":
        return t.Qwen2Config(**c, tie_word_embeddings=False)
    if family == "qwen3":
        return t.Qwen3Config(**c, head_dim=16, tie_word_embeddings=True)
    if family == "qwen3moe":
        return t.Qwen3MoeConfig(
            **c, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, tie_word_embeddings=False,
        )  # fmt: skip
    if family == "gemma3":
        cfg = t.Gemma3TextConfig(
            **{**c, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=4, layer_types=["sliding_attention", "sliding_attention",
                                           "full_attention"],
            sliding_window_pattern=3, final_logit_softcapping=5.0,
        )  # fmt: skip
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg
    if family == "gemma3mm":  # Gemma3ForConditionalGeneration: the 4B-27B checkpoints' class
        text = t.Gemma3TextConfig(
            **{**c, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=4, layer_types=["sliding_attention", "sliding_attention",
                                           "full_attention"],
            # as released: no final soft-capping (transformers' multimodal class applies none),
            # linear rope scaling 8 on the global layers
            final_logit_softcapping=None,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )  # fmt: skip
        vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, image_size=32,
                                      patch_size=8)  # fmt: skip
        return t.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
                              image_token_index=vocab - 1)  # fmt: skip
    if family == "gemma2":
        return t.Gemma2Config(**{**c, "num_hidden_layers": 3}, head_dim=16,
                              query_pre_attn_scalar=16, sliding_window=4,
                              final_logit_softcapping=5.0, attn_logit_softcapping=8.0)  # fmt: skip
    if family == "olmo2":
        return t.Olmo2Config(**c, tie_word_embeddings=False, rope_theta=10000.0)
    if family == "smollm3":  # four layers: the fourth has no rope
        return t.SmolLM3Config(**{**c, "num_hidden_layers": 4}, tie_word_embeddings=True,
                               pad_token_id=0)  # fmt: skip
    if family == "glm4moe":  # GLM-4.5's layout: a dense first layer, shared experts, biases
        return t.Glm4MoeConfig(
            **{**c, "num_hidden_layers": 3}, head_dim=16, partial_rotary_factor=0.5,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
            num_nextn_predict_layers=1, rope_theta=1e6, tie_word_embeddings=False,
        )  # fmt: skip
    if family == "phi3":
        return t.Phi3Config(**{**c, "num_key_value_heads": 4}, tie_word_embeddings=False,
                            pad_token_id=0, partial_rotary_factor=0.5)  # fmt: skip
    raise KeyError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "gemma3mm", "phi3",
            "gemma2", "olmo2", "smollm3", "glm4moe")  # fmt: skip
# families whose transformers class came late: their tests skip on an older transformers
NEEDS = {"glm4moe": "Glm4MoeConfig"}


def available(family: str) -> bool:
    """Whether the installed transformers has the family's classes."""
    import transformers

    return hasattr(transformers, NEEDS.get(family, "AutoConfig"))


# the multimodal Gemma 3 vocabulary ends with its image tokens (ids vocab-3 .. vocab-1)
IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# the added tokens llama.cpp's GLM converter looks up (bos, eot, eom)
GLM_TOKENS = ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"]
EXTRA_TOKENS = {"gemma3mm": IMAGE_TOKENS, "glm4moe": GLM_TOKENS}


def tokenizer(spm: bool = False, extra: list[str] | tuple[str, ...] = ()):
    """A trained tiny tokenizer wrapped for save_pretrained (transformers' fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if spm:  # SentencePiece-style: ▁ for spaces, <0xNN> byte fallback, no space prefix (Gemma 3)
        norm = normalizers.Replace(" ", "▁")
        trained = Tokenizer(models.BPE())
        trained.normalizer = norm
        trained.train_from_iterator(
            CORPUS, trainers.BpeTrainer(vocab_size=VOCAB - 256, show_progress=False)
        )
        learned = json.loads(trained.to_str())["model"]
        # the byte tokens live in the vocabulary, as in a converted SentencePiece model
        vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
        for t in sorted(learned["vocab"], key=learned["vocab"].get):
            vocab.setdefault(t, len(vocab))
        merges = [
            tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]
        ]
        tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, fuse_unk=False))
        tok.normalizer = norm
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        tok.add_special_tokens(SPECIALS)
    else:  # byte-level BPE (GPT-2 / Llama 3 / Qwen)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(list(extra))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[2],
        pad_token=SPECIALS[0],
        chat_template=CHATML,
    )


def model(family: str, vocab: int = VOCAB, width: int | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    m = AutoModelForCausalLM.from_config(config(family, vocab, width), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() > 1:  # fan-in scaled: logits of std ~1 through the layers
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif "norm" in name:
                centre = 0.0 if family.startswith("gemma") else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return m.to(torch.bfloat16)


def save_tiny(family: str, folder: Path, shards: bool = False, width: int | None = None) -> Path:
    """Write the family's tiny folder (`shards`: split in several files with an index)."""
    tok = tokenizer(spm=family.startswith("gemma"), extra=EXTRA_TOKENS.get(family, ()))
    m = model(family, max(VOCAB, len(tok)), width)
    m.generation_config.eos_token_id = [0, 2]  # <|endoftext|> and <|im_end|>
    size = "20KB" if shards else "50GB"
    m.save_pretrained(folder, max_shard_size=size)
    tok.save_pretrained(folder)
    if family == "glm4moe":
        add_nextn_layer(folder, m.config)
    return folder


def add_nextn_layer(folder: Path, config) -> None:
    """The NextN (multi-token prediction) layer GLM checkpoints ship after the last layer, which
    transformers neither builds nor saves: the last layer's tensors perturbed, plus eh_proj,
    enorm, hnorm and shared_head.norm (seeded; never run by transformers, llama.cpp or us)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    last, nextn = config.num_hidden_layers - 1, config.num_hidden_layers
    g = torch.Generator().manual_seed(SEED + 1)
    prefix = f"model.layers.{last}."
    for k in [k for k in state if k.startswith(prefix)]:
        t = state[k]
        noise = 0.1 * torch.randn(t.shape, generator=g)
        state[k.replace(prefix, f"model.layers.{nextn}.")] = (t.float() + noise).to(t.dtype)
    d = config.hidden_size
    state[f"model.layers.{nextn}.eh_proj.weight"] = torch.randn(d, 2 * d, generator=g).bfloat16()
    for n in ("enorm", "hnorm", "shared_head.norm"):
        state[f"model.layers.{nextn}.{n}.weight"] = torch.ones(d, dtype=torch.bfloat16)
    save_file(state, str(path), metadata={"format": "pt"})
