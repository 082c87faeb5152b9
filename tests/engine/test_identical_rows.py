"""Identical prompts in one engine step must give identical greedy text (batch invariance of the
CPU path). It failed while the torch path's batched decode attention ran on torch's batched
matmuls, whose first matrix got other bits than the rest (now `kernels.cpu.paged_decode`)."""

import pytest

from localllm.engine.llm import LLM
from localllm.engine.sampling.params import SamplingParams


def test_identical_prompts_in_one_step_end_alike(smollm2_path):
    llm = LLM(str(smollm2_path), max_model_len=1024, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for i, prompt in enumerate(["Once upon a time", "Once upon a time"]):
        engine.add_request(f"a{i}", prompt, params)
    engine.step()  # both prompts in this step
    for i, prompt in enumerate(["The quick brown fox", "The quick brown fox"]):
        engine.add_request(f"b{i}", prompt, params)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    engine.close()
    assert texts["a0"] == texts["a1"] and texts["b0"] == texts["b1"], texts


@pytest.mark.parametrize("stagger", [1, 2])
def test_a_prompt_joining_mid_decode_changes_no_ones_tokens(smollm2_path, stagger):
    """Requests that arrive while others decode (steps mixing decode and prompt rows) end with
    the tokens they get arriving together. Mixed steps used to run the decode rows through the
    torch layers (float32 linears) instead of the native step (int8 activations): near-ties then
    went the other way ('fox' / 'bear')."""
    llm = LLM(str(smollm2_path), max_model_len=1024, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The quick brown fox", "Once upon a time", "The quick brown fox"]

    def run(tag: str, steps_between: int) -> dict[int, list[int]]:
        done = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}{i}", prompt, params)
            for _ in range(steps_between):
                for out in engine.step():
                    if out.finished:
                        done[int(out.request_id[-1])] = out.outputs[0].token_ids
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id[-1])] = out.outputs[0].token_ids
        return done

    together = run("t", 0)
    staggered = run("s", stagger)
    engine.close()
    assert staggered == together and together[0] == together[2], (together, staggered)
