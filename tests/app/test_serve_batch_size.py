"""`serve -b/--batch-size`: the tokens of one engine step (prompt chunks included) reach the
scheduler that the server's engine runs; a bad value is refused before any model is opened."""

import dataclasses

import pytest

from localllm.app.cli import build_parser
from localllm.app.engine_flags import engine_kwargs
from localllm.engine import LLM, SamplingParams
from tests.perf.make_synthetic import SHAPES, write_synthetic


def _kwargs(*flags: str) -> dict:
    args = build_parser().parse_args(["serve", "-m", "x.gguf", *flags])
    return engine_kwargs(args)


def test_batch_size_reaches_the_scheduler(tmp_path):
    assert _kwargs()["max_num_batched_tokens"] == 512  # the documented defaults: CPU, GPU
    assert _kwargs("--device", "cuda")["max_num_batched_tokens"] == 2048
    assert _kwargs("--device", "cuda", "-b", "512")["max_num_batched_tokens"] == 512
    kw = _kwargs("-np", "2", "-b", "64", "--threads", "1")
    assert kw["max_num_batched_tokens"] == 64 and kw["max_num_seqs"] == 2
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q8_0", None, seed=1)
    llm = LLM(str(path), max_model_len=512, **{k: v for k, v in kw.items() if k != "max_model_len"})
    sched = llm.engine.scheduler
    assert sched.config.max_num_batched_tokens == 64
    steps = []
    step = llm.engine.step

    def counted():
        steps.append(None)
        return step()

    llm.engine.step = counted
    # a 300-token prompt takes ceil(300 / 64) = 5 steps before its first token, then 1 a token
    out = llm.generate([list(range(3, 303))], SamplingParams(temperature=0, max_tokens=2,
                                                              ignore_eos=True))  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2
    assert len(steps) == 5 + 1


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        _kwargs("-b", "0")
