"""Hyperparameters of a GGUF model, checked before anything is built or allocated from them.

A corrupt or hostile file must fail with one clear line, not build layers for minutes (a
`block_count` of 2^31), make torch allocate gigabytes (a width near 2^31), divide by zero (no
heads) or give NaN logits (a zero rope base, a negative norm epsilon). Three checks shared by
every family, none of which knows one:
- `read`: each `{arch}.*` key a family reads (through `common.arch_key`) against the table
  `HPARAMS`: its type and a sane range;
- `check_tensors`: what the tensors' shapes fix agrees with the metadata (the layer count, the
  embedding width, the vocabulary), and no width is larger than the file's layers could hold, so
  layers built from the metadata cost at most a few times the file's own values;
- `check_args`: relations between the `ModelArgs` fields the families share (the heads divide,
  rope fits in a head, the experts used are among the experts).
A family checks the relations of its own keys in `ModelArgs.check()`.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Limits on what a file may declare (documented in the README's "Limits"); every released model
# is far inside them.
MAX_LAYERS = 4096  # the deepest released models have ~130 layers
MAX_WIDTH = 1 << 20  # any width: embedding, FFN, heads, head size, LoRA rank, expert count
MAX_CONTEXT = 1 << 24  # 16M tokens: float32 positions are exact up to here (the longest: 10M)
MAX_VOCAB = 1 << 24
MAX_ROPE_BASE = 1e15
MAX_SCALE = 1e6  # rope scaling factors, expert weight scale, logit soft-cap


class HyperparameterError(ValueError):
    """A hyperparameter of the wrong type, out of its range, or at odds with the tensors."""


class _Refused(Exception):
    """A kind's reason to refuse a value (`read` adds the key and the value)."""


@dataclass(frozen=True)
class Int:
    """An integer in lo..hi. `width`: it sizes tensors in every layer (see `check_tensors`);
    `lenient`: a value that is not an integer is left to the family (which has a default);
    `per_layer`: a list of one per layer is taken too, each in 0..hi (0: a hybrid's layer
    without it, e.g. no KV heads in a recurrent layer)."""

    lo: int
    hi: int
    width: bool = False
    lenient: bool = False
    per_layer: bool = False

    def check(self, value: Any) -> Any:
        if self.per_layer and not isinstance(value, (int, list)) and hasattr(value, "tolist"):
            value = value.tolist()  # the GGUF reader's array
        if self.per_layer and type(value) is list:
            if not value or any(type(v) is not int or not 0 <= v <= self.hi for v in value):
                raise _Refused(f"expected a list of integers in 0..{self.hi}, one per layer")
            return list(value)
        if type(value) is not int:
            if self.lenient:
                return value
            raise _Refused(f"expected an integer in {self.lo}..{self.hi}")
        if not self.lo <= value <= self.hi:
            raise _Refused(f"expected {self.lo}..{self.hi}")
        return value


@dataclass(frozen=True)
class Real:
    """A finite number in [lo, hi] (lo excluded when `above`); 0 also when `zero_means_none`."""

    lo: float
    hi: float
    above: bool = False
    zero_means_none: bool = False

    def check(self, value: Any) -> float:
        rng = f"{'(' if self.above else '['}{self.lo:g}, {self.hi:g}]"
        rng = f"0 or {rng}" if self.zero_means_none else rng
        if type(value) not in (int, float):
            raise _Refused(f"expected a number in {rng}")
        v = float(value)
        if v == 0 and self.zero_means_none:
            return v
        if not (
            math.isfinite(v) and (v > self.lo if self.above else v >= self.lo) and v <= self.hi
        ):
            raise _Refused(f"expected a finite number in {rng}")
        return v


@dataclass(frozen=True)
class Ints:
    """A list of at most `n` integers, each in lo..hi (M-RoPE's rope sections)."""

    lo: int
    hi: int
    n: int

    def check(self, value: Any) -> list[int]:
        if not isinstance(value, list) and hasattr(value, "tolist"):
            value = value.tolist()  # the GGUF reader's array
        if (
            type(value) is not list
            or not 0 < len(value) <= self.n
            or any(type(v) is not int or not self.lo <= v <= self.hi for v in value)
        ):
            raise _Refused(f"expected at most {self.n} integers in {self.lo}..{self.hi}")
        return list(value)


class Flag:
    def check(self, value: Any) -> bool:
        if type(value) is bool or (type(value) is int and value in (0, 1)):
            return bool(value)
        raise _Refused("expected a boolean")


class Text:
    def check(self, value: Any) -> str:
        if type(value) is not str:
            raise _Refused("expected a string")
        return value


def _width(lo: int = 1) -> Int:
    return Int(lo, MAX_WIDTH, width=True)


EPSILON = Real(0.0, 1.0, above=True)
# Every `{arch}.*` key a family reads, by its name after the architecture (llama.cpp's LLM_KV
# names). tests/engine/test_gguf_hparams_table.py checks no family reads a key missing here.
HPARAMS: Mapping[str, Any] = {
    "block_count": Int(1, MAX_LAYERS),
    "context_length": Int(2, MAX_CONTEXT),  # a prompt token and one generated
    "embedding_length": _width(),
    "feed_forward_length": _width(),
    "expert_feed_forward_length": _width(),
    "attention.head_count": _width(),
    "attention.head_count_kv": Int(1, MAX_WIDTH, width=True, per_layer=True),
    "attention.key_length": _width(),
    "attention.value_length": _width(),
    "attention.key_length_mla": _width(),
    "attention.value_length_mla": _width(),
    "attention.q_lora_rank": _width(0),  # 0: a plain query projection
    "attention.kv_lora_rank": _width(),
    "attention.layer_norm_epsilon": EPSILON,
    "attention.layer_norm_rms_epsilon": EPSILON,
    "attention.sliding_window": Int(0, MAX_CONTEXT),
    "attention.sliding_window_pattern": Int(0, MAX_LAYERS, lenient=True),
    "rope.dimension_count": _width(),
    # above 1: YaRN divides by log(base); below, the frequencies overflow float32
    "rope.freq_base": Real(1.0, MAX_ROPE_BASE, above=True),
    "rope.dimension_sections": Ints(0, MAX_WIDTH, 4),  # M-RoPE: frequencies per t/h/w axis
    "n_deepstack_layers": Int(0, MAX_LAYERS),  # qwen3vl: layers that take deepstack rows
    "rope.freq_base_swa": Real(1.0, MAX_ROPE_BASE, above=True),
    "rope.scaling.type": Text(),
    # llama.cpp reads a factor of 0 as no scaling; below 1 no released model shrinks its context
    "rope.scaling.factor": Real(1.0, MAX_SCALE, zero_means_none=True),
    "rope.scaling.attn_factor": Real(0.0, 100.0, above=True),
    "rope.scaling.original_context_length": Int(1, MAX_CONTEXT),
    "rope.scaling.yarn_beta_fast": Real(0.0, 1e4, above=True),
    "rope.scaling.yarn_beta_slow": Real(0.0, 1e4, above=True),
    "rope.scaling.yarn_log_multiplier": Real(0.0, 10.0),
    "expert_count": _width(0),
    "expert_used_count": Int(0, MAX_WIDTH),
    "expert_shared_count": Int(0, MAX_WIDTH),
    "expert_group_count": Int(1, MAX_WIDTH),
    "expert_group_used_count": Int(1, MAX_WIDTH),
    "expert_gating_func": Int(0, 2),  # llama.cpp's enum: none (softmax), softmax, sigmoid
    "expert_weights_scale": Real(0.0, MAX_SCALE),
    "expert_weights_norm": Flag(),
    "leading_dense_block_count": Int(0, MAX_LAYERS),
    "final_logit_softcapping": Real(0.0, MAX_SCALE),
    "attn_logit_softcapping": Real(0.0, MAX_SCALE),  # gemma2: 0 is no cap
    "nextn_predict_layers": Int(0, MAX_LAYERS),  # glm4moe's multi-token-prediction blocks
    "expert_shared_feed_forward_length": _width(),  # qwen3next's shared expert
    "full_attention_interval": Int(1, MAX_LAYERS),  # qwen3next: every Nth layer attends
    "ssm.conv_kernel": Int(1, 1024),  # short-conv taps (4 in every released model)
    "ssm.state_size": _width(),
    "ssm.group_count": _width(),
    "ssm.time_step_rank": _width(),
    "ssm.inner_size": _width(),
    "shortconv.l_cache": Int(2, 1024),  # lfm2: the short conv's taps (3 in every release)
    # granitehybrid's multipliers (transformers' embedding/attention/residual_multiplier and
    # logits_scaling, a divisor)
    "attention.scale": Real(0.0, MAX_SCALE, above=True),
    "embedding_scale": Real(0.0, MAX_SCALE, above=True),
    "residual_scale": Real(0.0, MAX_SCALE, above=True),
    "logit_scale": Real(0.0, MAX_SCALE, above=True),
    "rope.scaling.finetuned": Flag(),  # granitehybrid: rope on (Bamba) or off (Granite 4.0-H)
    "pooling_type": Int(0, 4),  # llama.cpp's enum: none, mean, cls, last, rank
    "vocab_size": Int(1, MAX_VOCAB),
    "token_type_count": Int(1, MAX_WIDTH),  # bert reads `tokenizer.ggml.token_type_count`
}

_BLOCK = re.compile(r"blk\.(\d+)\.")


def read(key: str, name: str, value: Any) -> Any:
    """`value` of metadata `key` (`{arch}.{name}`), checked against `HPARAMS[name]`."""
    kind = HPARAMS.get(name)
    if kind is None:
        return value
    try:
        return kind.check(value)
    except _Refused as e:
        raise HyperparameterError(f"metadata {key!r} is {_show(value)}, {e}") from None


def check_tensors(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """What the tensors' shapes fix agrees with the metadata (`tensors`: name -> an object with
    a torch-order `shape`); the keys compared are checked for type and range on the way."""
    arch = meta.get("general.architecture")
    if type(arch) is not str:
        raise HyperparameterError(f"metadata 'general.architecture' is {_show(arch)}")
    embd = tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise HyperparameterError("no 2-D 'token_embd.weight' tensor (the token embedding)")
    vocab, width = embd.shape

    def value(name: str) -> Any:
        key = f"{arch}.{name}"
        return read(key, name, meta[key]) if key in meta else None

    for name, expected in (("embedding_length", width), ("vocab_size", vocab)):
        got = value(name)
        if got is not None and got != expected:
            raise HyperparameterError(
                f"metadata '{arch}.{name}' is {got} but token_embd.weight is {vocab} x {width}"
            )
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != vocab:
        raise HyperparameterError(
            f"the vocabulary has {len(tokens)} tokens but token_embd.weight has {vocab} rows"
        )
    n_layers = value("block_count")
    if n_layers is None:
        return  # the family reports the missing key
    blocks: set[int] = set()
    elements = 0
    for name, t in tensors.items():
        m = _BLOCK.match(name)
        if m is not None:
            blocks.add(int(m[1]))
            elements += math.prod(t.shape)
    if blocks != set(range(n_layers)):
        nums = sorted(blocks)
        have = ", ".join(map(str, nums[:6])) + (", ..." if len(nums) > 6 else "")
        raise HyperparameterError(
            f"metadata '{arch}.block_count' is {n_layers} but the file has tensors for "
            f"{len(blocks)} blocks" + (f" (blk.{have})" if nums else "")
        )
    # A width sizes tensors in every layer, so the layers hold at least n_layers * width values;
    # a larger one cannot be right, and would make the model allocate beyond the file's size.
    # (Only integers: a family that reads a key checks its type; keys it ignores may be anything.)
    for name, kind in HPARAMS.items():
        got = meta.get(f"{arch}.{name}") if isinstance(kind, Int) and kind.width else None
        got = got.tolist() if hasattr(got, "tolist") else got  # (a GGUF array)
        if type(got) is list and got and all(type(v) is int for v in got):
            got = max(got)  # a per-layer list: its widest layer
        if type(got) is int and n_layers * got > elements:
            raise HyperparameterError(
                f"metadata '{arch}.{name}' is {got}, more than {n_layers} layers of "
                f"{elements} values in all can hold"
            )


def check_args(args: Any) -> None:
    """Relations between the `ModelArgs` fields the families share (those a family has)."""
    if args.head_dim < 1:
        raise HyperparameterError(
            f"attention head size is {args.head_dim} (embedding_length {args.dim} / "
            f"head_count {args.n_heads}); expected at least 1"
        )
    kv = getattr(args, "n_kv_heads", None)
    if type(kv) is list:  # only the hybrids read per-layer lists, into fields of their own
        raise HyperparameterError(
            f"attention.head_count_kv is a list per layer; {getattr(args, 'arch', 'this family')} "
            "takes one value"
        )
    if kv is not None and (kv > args.n_heads or args.n_heads % kv):
        raise HyperparameterError(
            f"attention.head_count_kv is {kv}, expected a divisor of head_count {args.n_heads}"
        )
    rope = getattr(args, "rope_dims", None)
    if rope is not None and (rope > args.head_dim or rope % 2):
        raise HyperparameterError(
            f"rope.dimension_count is {rope}, expected an even number up to the head size "
            f"{args.head_dim}"
        )
    n_expert, used = getattr(args, "n_expert", 0), getattr(args, "n_expert_used", 0)
    if n_expert and not 1 <= used <= n_expert:
        raise HyperparameterError(
            f"expert_used_count is {used}, expected 1..{n_expert} (expert_count)"
        )


def _show(value: Any) -> str:
    """A value as an error shows it: short, whatever its type."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
