"""A hybrid model's recurrent-state slots in the residency plan and the memory budget, and prefix
caching on a hybrid (off: a repeated prompt gives a fresh run's output).

The plan counts the state the engine will allocate (one slot per sequence of --parallel plus the
scratch slot the decode graphs' padding uses), shows it beside the KV cache, and refuses a budget
the state does not fit in; a model without recurrent layers has none. Loaded through the engine
under a plan, the state it allocates is the plan's figure. On the converted tiny fixtures.
"""

import pytest

from localllm.engine.gguf import open_gguf
from localllm.engine.llm import LLM
from localllm.engine.loader import build_model
from localllm.engine.moe.residency import plan_model
from localllm.engine.runtime.recurrent_state import RecurrentState, state_shapes
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.memory import MemoryInfo
from localllm.offload.plan import fmt_bytes
from localllm.offload.residency import ResidencyError, resolve
from tests.engine.family_goldens import golden, path

HYBRIDS = ["lfm2", "lfm2moe", "granitehybrid", "qwen3next"]
CPU = MemoryInfo("cpu", host_free=1 << 30)


def _plan(g, seqs: int, budget: int | None = None):
    config = resolve([("t", {"budget": budget})] if budget else [])
    return plan_model(g, config, kv_tokens=64, memory=CPU, state_seqs=seqs)


@pytest.mark.parametrize("name", HYBRIDS)
def test_plan_counts_the_state_slots(name):
    with open_gguf(path(name)) as g:
        shapes = state_shapes(build_model(g))
        for seqs in (1, 4):
            plan = _plan(g, seqs)
            want = RecurrentState(shapes, seqs).nbytes  # what the engine allocates
            assert plan.state_bytes == want > 0
            line = f"states   {fmt_bytes(want):>11}  (recurrent state slots)"
            assert line in plan.describe()
        assert _plan(g, 8).state_bytes == 9 * _plan(g, 1).state_bytes // 2  # 9 slots against 2


def test_no_state_without_recurrent_layers():
    with open_gguf(path("glm4moe")) as g:
        plan = _plan(g, 16)
    assert plan.state_bytes == 0 and "recurrent state" not in plan.describe()


@pytest.mark.parametrize("name", ["lfm2", "granitehybrid_dense"])  # (no experts to move off)
def test_budget_must_hold_the_state(name):
    with open_gguf(path(name)) as g:
        one = _plan(g, 1)
        # everything the budget covers on a CPU (device and host tiers are one pool)
        need = sum(one.sizes.values()) + one.kv_bytes + one.scratch_bytes + one.state_bytes
        assert "planned use" in _plan(g, 1, budget=need).describe()  # fits exactly
        with pytest.raises(ResidencyError, match="the recurrent state"):
            _plan(g, 2, budget=need)  # one slot more does not


def test_engine_allocates_what_the_plan_counted():
    with LLM(str(path("lfm2")), max_model_len=64, max_num_seqs=3, residency=resolve([])) as llm:
        plan = llm.engine.model.residency_plan
        assert llm.engine.kv_cache.states.nbytes == plan.state_bytes
        assert llm.engine.kv_cache.states.num_slots == 3


@pytest.mark.parametrize("name", ["lfm2", "granitehybrid", "qwen3next"])
def test_repeated_prompt_with_prefix_caching_equals_fresh_run(name):
    """Prefix caching is off for hybrids (a cached prefix's KV without the state after it would
    be wrong): asked for, a repeated prompt recomputes and ends as a fresh engine's run."""
    prompt = golden(name)["prompt"]["ids"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {"max_model_len": 128, "block_size": 4, "precise": True}
    with LLM(str(path(name)), enable_prefix_caching=True, **kw) as llm:
        runs = [list(llm.generate([prompt], params)[0].outputs[0].token_ids) for _ in range(2)]
        manager = llm.engine.kv_manager
        assert not manager.enable_caching and manager.stats.hits == 0
    with LLM(str(path(name)), **kw) as fresh:
        want = list(fresh.generate([prompt], params)[0].outputs[0].token_ids)
    assert runs == [want, want]
