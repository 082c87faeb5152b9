"""Scheduler bookkeeping on CPU, exact: budget splits, chunk boundaries, preemption and resume,
prefix hits, forks for n > 1, draft scheduling and rollback. No model runs here: a fake runner
"samples" a fixed token so every count is predictable."""

from localllm.engine.core.kv_manager import KVCacheManager
from localllm.engine.core.request import Request, RequestStatus
from localllm.engine.core.scheduler import Scheduler, SchedulerConfig
from localllm.engine.sampling.params import SamplingParams

BS = 4


def make(num_blocks=64, seqs=8, budget=16, max_len=256, caching=True):
    kv = KVCacheManager(BS, num_blocks, enable_caching=caching)
    return Scheduler(SchedulerConfig(seqs, budget, max_len), kv)


def req(rid, n, max_tokens=8, first=0, **params):
    p = SamplingParams(temperature=0, **params)
    return Request(
        rid, list(range(first, first + n)), p, eos_ids=frozenset({999}), max_tokens=max_tokens
    )


def step(s, token=7):
    """Schedule, 'sample' `token` for every request that reached its end, update."""
    out = s.schedule()
    sampled = {}
    for r in out.requests:
        n = out.num_scheduled_tokens[r.request_id]
        if r.num_computed_tokens + n >= r.num_tokens:
            spec = out.spec_tokens.get(r.request_id, [])
            sampled[r.request_id] = [token] * (1 + len(spec))
    s.update_from_output(out, sampled)
    return out


def test_budget_split_and_chunked_prefill_boundaries():
    s = make(budget=16)
    a, b = req("a", 10), req("b", 20)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prompt is chunked
    s.update_from_output(out, {"a": [7]})
    assert (a.num_computed_tokens, a.output_token_ids) == (10, [7])
    assert b.num_computed_tokens == 6 and b.output_token_ids == []
    # running first: a decodes 1, b continues its prompt with the rest of the budget
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 14}
    s.update_from_output(out, {"a": [7], "b": [7]})
    assert b.num_computed_tokens == 20 and b.output_token_ids == [7]
    assert step(s).num_scheduled_tokens == {"a": 1, "b": 1}


def test_max_num_seqs_limits_admission():
    s = make(seqs=2, budget=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, first=100 * i))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_finish_by_length_eos_and_stop_token_frees_blocks():
    s = make(budget=100)
    a = req("a", 5, max_tokens=2)
    b = req("b", 5, first=50)
    c = req("c", 5, first=80, stop_token_ids=[42])
    for r in (a, b, c):
        s.add_request(r)
    step(s, token=7)
    out = s.schedule()
    s.update_from_output(out, {"a": [7], "b": [999], "c": [42]})
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("length", "stop", "stop")
    assert (b.stop_reason, c.stop_reason) == (999, 42)
    assert not s.running and s.kv.num_free_blocks == 64


def test_preemption_by_recompute_and_resume():
    # 6 blocks of 4 tokens: two requests of 8-token prompts fill 4; decoding grows them until
    # the newest is preempted, then it resumes with recomputation and ends with the same tokens.
    s = make(num_blocks=6, budget=64, caching=False)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, first=100)
    s.add_request(a)
    s.add_request(b)
    preempted_at = None
    for i in range(40):
        out = step(s)
        if out.preempted and preempted_at is None:
            preempted_at = i
            assert out.preempted == [b] and b.status is RequestStatus.PREEMPTED
            assert b.num_computed_tokens == 0 and s.waiting[0] is b
        if not s.has_unfinished():
            break
    assert preempted_at is not None
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert b.metrics.num_preemptions == 1 and s.kv.num_free_blocks == 6


def test_prefix_hit_counts_and_leaves_one_token():
    s = make(budget=100)
    a = req("a", 12, max_tokens=1)
    s.add_request(a)
    step(s)
    assert a.finished
    b = req("b", 12, max_tokens=1)  # same prompt: 2 of 3 blocks hit (one token must compute)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 4} and b.num_cached_tokens == 8
    assert s.kv.stats.hits == 8


def test_fork_waits_for_prompt_then_shares_blocks():
    s = make(budget=8)
    parent = req("p", 10, max_tokens=3)
    child = req("p#1", 10, max_tokens=3)
    child.fork_of = parent
    s.add_request(parent)
    s.add_request(child)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"p": 8}  # the child waits for the prompt KV
    s.update_from_output(out, {})
    out = s.schedule()
    # parent finishes its prompt (2 tokens); child shares 2 full blocks, computes the last 2
    assert out.num_scheduled_tokens == {"p": 2, "p#1": 2}
    assert s.kv.get_block_ids(child)[:2] == s.kv.get_block_ids(parent)[:2]
    assert len(s.kv.get_block_ids(child)) == 3  # its own block for tokens 8..9
    assert s.kv.get_block_ids(child)[2] != s.kv.get_block_ids(parent)[2]
    assert child.num_computed_tokens == 8


def test_spec_tokens_scheduled_and_rolled_back():
    s = make(budget=100)
    a = req("a", 6, max_tokens=10)
    s.add_request(a)
    step(s)  # prompt + first token
    a.spec_token_ids = [7, 5, 3]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.spec_tokens == {"a": [7, 5, 3]}
    # target agrees with the first draft only: 7 accepted, then 8 sampled instead of 5
    s.update_from_output(out, {"a": [7, 8]})
    assert a.output_token_ids == [7, 7, 8]
    assert a.num_computed_tokens == 8  # prompt 6 + two inputs with valid KV; 8 is not computed
    assert (a.metrics.spec_proposed, a.metrics.spec_accepted) == (3, 1)


def test_spec_tokens_trimmed_by_budget():
    s = make(budget=3)
    a = req("a", 2, max_tokens=10)
    s.add_request(a)
    step(s)
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.spec_tokens == {"a": [1, 2]}


def test_abort_waiting_and_running():
    s = make(seqs=1, budget=100)
    a, b = req("a", 5), req("b", 5, first=10)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish(b, "abort")
    s.finish(a, "abort")
    assert a.finish_reason == b.finish_reason == "abort"
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_lookahead_slot_allocated_only_from_free_blocks():
    """With a lookahead slot a decode token's next slot comes with it (the runner's step ahead
    writes there), but only from free blocks: never by preempting."""
    kv = KVCacheManager(BS, 2, enable_caching=False)
    s = Scheduler(SchedulerConfig(8, 64, 256, lookahead_slots=1), kv)
    a = req("a", 3, max_tokens=6)  # decodes positions 3..7: 2 blocks, the pool's all
    s.add_request(a)
    step(s)  # the prompt: 1 block (no lookahead on a prompt)
    assert len(kv.get_block_ids(a)) == 1
    step(s)  # decodes position 3; position 4's slot comes with it: the second block
    assert a.num_computed_tokens == 4 and len(kv.get_block_ids(a)) == 2
    while s.has_unfinished():  # at position 7 the next slot has no block: none taken, none lost
        assert not step(s).preempted
    assert a.output_token_ids == [7] * 6 and kv.num_free_blocks == 2


def test_lookahead_stops_at_max_model_len():
    kv = KVCacheManager(BS, 8, enable_caching=False)
    s = Scheduler(SchedulerConfig(8, 64, 8, lookahead_slots=1), kv)
    a = req("a", 4, max_tokens=4)
    s.add_request(a)
    while s.has_unfinished():
        step(s)
    assert a.num_tokens == 8 and kv.num_free_blocks == 8  # 2 blocks at most held, all freed
