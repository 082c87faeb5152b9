"""Seeded fuzzing of hyperparameters, vocabularies, tensors and header bytes in every family.

Each case takes one family's tiny runnable model (hostile_gguf.py) and mutates one to three
things: a hyperparameter set to an extreme, a wrong type or removed; the vocabulary cut, flipped
or relabelled; a tensor dropped or reshaped; a few header bits flipped. It then loads the file as
the engine does. Allowed outcomes: a ValueError (GGUFError is one) whose message starts with the
file's path; or a model that loads and then generates (bert: embeds) without any error, which
also proves its logits finite (the sampler refuses NaN). Every case runs under `load_limits`: a
watchdog and an address-space budget, so a hang or an allocation sized from a hostile value fails.

LOCALLLM_FUZZ_CASES sets the number of cases (default 400: a few seconds; 6000 took 3 minutes).
"""

import logging
import math
import os

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from localllm.engine.gguf import open_gguf
from localllm.engine.llm import LLM
from localllm.engine.models.hparams import HPARAMS
from localllm.engine.sampling.params import SamplingParams
from tests.engine.gguf_fixtures import GGUFValue
from tests.engine.hostile_gguf import (
    DELETE,
    FAMILIES,
    TOKENS,
    base,
    flipped_token,
    write_variant,
)
from tests.engine.load_limits import LoadTimeout, load_limits

CASES = int(os.environ.get("LOCALLLM_FUZZ_CASES", "400"))
ENGINE = {"kv_cache_memory": 1 << 20, "max_num_seqs": 2}
INTS = [0, 1, 2, 3, 7, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, -1, -(2**31)]
FLOATS = [0.0, -0.0, -1.0, 0.5, 1.0, 1e-45, 1e-30, 1e30, 3.4e38, math.nan, math.inf, -math.inf]
ODD = ["x", "", True, [1, 2], np.array([3, 3], np.int32), DELETE]


def _int_value(rng, v: int):
    if v < 0:
        return GGUFValue(v, VT.INT64 if v < -(2**31) else VT.INT32)
    return GGUFValue(v, VT.UINT64 if v >= 2**32 else rng.choice([VT.UINT32, VT.INT64]))


def _hparam(rng, family: str) -> dict:
    arch, meta, _ = base(family)
    names = sorted(k for k in meta if k.startswith(f"{arch}."))  # the keys the family has
    if rng.random() < 0.3:  # or any key a family reads, which this one may lack
        names = sorted(f"{arch}.{n}" for n in HPARAMS)
    key = names[rng.integers(len(names))]
    old = meta.get(key)
    roll = rng.random()
    if roll < 0.35 and type(old) is int:  # near the real value: off by one, doubled, halved
        v = int(rng.choice([old - 1, old + 1, 2 * old, old // 2, old * 1024]))
        value = _int_value(rng, v)
    elif roll < 0.6:
        value = _int_value(rng, INTS[rng.integers(len(INTS))])  # exact: no float detour
    elif roll < 0.85:
        value = GGUFValue(float(rng.choice(FLOATS)), rng.choice([VT.FLOAT32, VT.FLOAT64]))
    else:
        value = ODD[rng.integers(len(ODD))]
    return {key: value}


def _vocabulary(rng, family: str) -> dict:
    meta = base(family)[1]
    tokens = meta[TOKENS]
    n = len(tokens)
    kind = rng.integers(7)
    if kind == 0:
        model = ["gpt2", "llama", "bert", "t5", "", DELETE][rng.integers(6)]
        return {"tokenizer.ggml.model": model}
    if kind == 1:
        cut = int(rng.integers(0, n + 5))
        return {TOKENS: (tokens + ["zz"] * 5)[:cut] or DELETE}
    if kind == 2:
        i = int(rng.integers(n))
        raw = tokens[i].encode()
        return {TOKENS: flipped_token(family, i, int(rng.integers(len(raw))), int(rng.integers(8)))}
    if kind == 3:
        size = int(rng.choice([0, 1, n - 1, n + 1]))
        arr = rng.integers(-3, 12, size).astype(np.int32)
        return {"tokenizer.ggml.token_type": arr if size else DELETE}
    if kind == 4:
        name = ["bos", "eos", "unknown", "padding", "eot"][rng.integers(5)]
        return {f"tokenizer.ggml.{name}_token_id": _int_value(rng, [n, 2**32 - 1][rng.integers(2)])}
    if kind == 5:
        return {"tokenizer.ggml.merges": [["a", "", "x y z", "a b c"][rng.integers(4)]] * 3}
    return {"tokenizer.ggml.pre": ["qwen2", "nonsense", "llama3", "gpt-4o"][rng.integers(4)]}


def _tensor(rng, family: str) -> dict:
    tensors = base(family)[2]
    names = sorted(tensors)
    name = names[rng.integers(len(names))]
    if rng.random() < 0.3:
        return {name: DELETE}
    shape = list(tensors[name][2])
    d = int(rng.integers(len(shape)))
    shape[d] = int(rng.choice([1, max(1, shape[d] - 1), shape[d] + 1, 2 * shape[d]]))
    return {name: (rng.standard_normal(shape) * 0.1).astype(np.float32)}


def _flip_header(rng, path) -> None:
    with open_gguf(path) as g:
        data_start = min(t.range.offset for t in g.tensors.values())
    raw = bytearray(path.read_bytes())
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(0, data_start))
        raw[pos] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(raw))


def make_case(tmp_path, i: int):
    """Case i: the file, whether header bits were flipped, and what was mutated."""
    rng = np.random.default_rng(i)
    family = FAMILIES[i % len(FAMILIES)]
    meta, tensors, flip = {}, {}, False
    for _ in range(int(rng.integers(1, 4))):
        roll = rng.random()
        if roll < 0.55:
            meta |= _hparam(rng, family)
        elif roll < 0.75:
            meta |= _vocabulary(rng, family)
        elif roll < 0.9:
            tensors |= _tensor(rng, family)
        else:
            flip = True
    path = write_variant(tmp_path / f"case{i}.gguf", family, meta, tensors)
    if flip:
        _flip_header(rng, path)
    what = {k: getattr(v, "value", v) for k, v in meta.items()}
    return path, flip, f"case {i} ({family}): {what!r:.300}, tensors {list(tensors)}, flip {flip}"


class _StepErrors(logging.Handler):
    """The exceptions the engine caught in its steps (it finishes the requests with 'error')."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record):
        if record.exc_info:
            self.errors.append(record.exc_info[1])


def run_case(path, weights_may_be_garbage: bool) -> str:
    """'refused', 'ran', or 'nan' (a flipped header bit made weight bytes garbage: the sampler
    refuses the NaN logits, as it must); anything else raises."""
    try:
        llm = LLM(str(path), **ENGINE)
    except ValueError as e:
        assert str(e).startswith(f"{path}: "), f"an error that does not name the file: {e}"
        return "refused"
    steps = _StepErrors()
    logging.getLogger("localllm.engine.llm_engine").addHandler(steps)
    try:
        with llm:
            ids = llm.tokenizer.encode("hi ab")
            assert ids, "a byte-level text encodes to no tokens"
            if llm.engine.generates:  # one prompt token: a context of 2 must take it
                prompt = {"prompt_token_ids": ids[-1:]}
                out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0]
                finish = out.outputs[0].finish_reason
            else:
                vec = llm.engine.embed([ids[:2]])[0].embedding
                finish = "stop" if all(math.isfinite(x) for x in vec) else "nan"
    finally:
        logging.getLogger("localllm.engine.llm_engine").removeHandler(steps)
    if finish in ("error", "nan") and weights_may_be_garbage:
        assert all("NaN" in str(e) for e in steps.errors), steps.errors
        return "nan"
    assert finish in ("stop", "length"), (finish, steps.errors)
    return "ran"


def test_limits_can_fail():
    """The watchdog and the budget the fuzz cases run under do catch a hang and a big allocation.
    (4 GiB, not 1: the budget bounds new address space, and a request the heap's free blocks
    already hold needs none — after a long test session glibc's heap can hold a free gigabyte,
    which let a 1 GiB probe through now and then. Without the limit 4 GiB maps fine on any box
    with that much memory, so the check can fail.)"""
    import torch

    with pytest.raises(RuntimeError), load_limits(budget=256 << 20):
        torch.empty(1 << 32, dtype=torch.uint8)  # (empty: nothing touched if it were mapped)
    with pytest.raises(LoadTimeout), load_limits(seconds=0.2):
        while True:
            pass


def test_fuzz_hyperparameters_and_header(tmp_path):
    outcomes = {"refused": 0, "ran": 0, "nan": 0}
    for i in range(CASES):
        path, flipped, what = make_case(tmp_path, i)
        try:
            with load_limits():
                outcomes[run_case(path, flipped)] += 1
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        path.unlink()
    # both outcomes occur: many mutations are caught, and harmless ones load and run
    assert outcomes["refused"] > CASES // 3 and outcomes["ran"] > CASES // 20, outcomes
