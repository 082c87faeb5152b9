"""The converted-family fixtures' specifications: each family's tiny transformers config, its
tokenizer's added tokens, its real chat template and the conversations rendered with it
(`record_family_fixtures.py` builds, converts and records them).

Never imports localllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks"},
]


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    config: dict
    template: str  # file in llama.cpp's models/templates, or "olmo2" (below)
    pre: str = ""  # BPE pre-tokenizer name the converter writes ("" for SentencePiece)
    added: list = field(default_factory=list)  # (text, special) added tokens
    special: dict = field(default_factory=dict)  # bos_token=... for the tokenizer
    renders: dict = field(default_factory=dict)  # name -> apply_chat_template kwargs
    mtp: bool = False  # GLM: append the checkpoint's NextN layer (converted, never run)
    gemma_norms: bool = False  # norm weights are offsets from 1 (Gemma's (1 + w))


# OLMo-2-1124-{7,13}B-Instruct tokenizer_config.json `chat_template` (llama.cpp carries none).
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    "{% endfor %}"
)

_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,  # room for a tools prompt (GLM: ~560 tokens)
}
_GLM_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]
_GLM_TEXT_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]
_GLM = Family(
    "Glm4MoeConfig",
    "Glm4MoeForCausalLM",
    {
        **_SMALL,
        "num_hidden_layers": 2,
        "head_dim": 8,
        "partial_rotary_factor": 0.5,
        "moe_intermediate_size": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "attention_bias": True,
        "use_qk_norm": True,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    },
    "GLM-4.6.jinja",
    pre="glm4",
    added=[(t, True) for t in _GLM_TOKENS] + [(t, False) for t in _GLM_TEXT_TOKENS],
    special={"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    renders={
        "chat": {"messages": CHAT},
        "tools": {"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]},
        "no_thinking": {"messages": CHAT[1:2], "enable_thinking": False},
    },
    mtp=True,
)

FAMILIES: dict[str, Family] = {
    # four layers: layer 3 is the first whose rope is skipped (NoPE every fourth)
    "smollm3": Family(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {
            **_SMALL,
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 4,
            "rope_theta": 5e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "HuggingFaceTB-SmolLM3-3B.jinja",
        pre="llama-bpe",
        added=[
            ("<|begin_of_text|>", True),
            ("<|end_of_text|>", True),
            ("<think>", False),
            ("</think>", False),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
        ],
        special={
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|end_of_text|>",
        },
        renders={
            "chat": {"messages": CHAT},
            "no_thinking": {"messages": CHAT, "enable_thinking": False},
        },
    ),
    "olmo2": Family(
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {
            **_SMALL,
            "num_hidden_layers": 2,
            "rope_theta": 5e5,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "olmo2",
        pre="dbrx",
        added=[
            ("<|endoftext|>", True),
            ("<|pad|>", True),
            ("<|system|>", False),
            ("<|user|>", False),
            ("<|assistant|>", False),
        ],
        special={
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|pad|>",
        },
        renders={"chat": {"messages": CHAT}},
    ),
    # layers 0 and 2 slide over 4 tokens, layer 1 is global; strong soft-caps so both matter
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_SMALL,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 4,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "rope_theta": 1e4,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        },
        "google-gemma-2-2b-it.jinja",
        renders={"chat": {"messages": CHAT[1:]}},
        gemma_norms=True,
    ),
    # GLM-4.5 / 4.6 (355B): q/k norms; GLM-4.5-Air: none. Both with biases, an MTP layer.
    "glm4moe": _GLM,
    "glm4moe_air": Family(
        _GLM.config_class,
        _GLM.model_class,
        {**_GLM.config, "use_qk_norm": False, "routed_scaling_factor": 1.0},
        _GLM.template,
        pre=_GLM.pre,
        added=_GLM.added,
        special=_GLM.special,
        renders={"tools": _GLM.renders["tools"]},
        mtp=True,
    ),
}
