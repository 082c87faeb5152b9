"""Recurrent-state slots through the KV manager and the scheduler (no model): a slot per running
request, given back at finish and preemption, no prefix caching, and forks of n > 1 that share
the prompt's KV only from the step where the sibling's state is exactly there (copied)."""

import pytest

from localllm.engine.core.kv_manager import KVCacheManager
from localllm.engine.core.request import Request, RequestStatus
from localllm.engine.core.scheduler import Scheduler, SchedulerConfig
from localllm.engine.core.state_slots import StateSlots
from localllm.engine.sampling.params import SamplingParams
from tests.engine.core.test_scheduler import step

BS = 4


def make(num_blocks=64, seqs=4, budget=64, max_len=256):
    kv = KVCacheManager(BS, num_blocks, enable_caching=True, state_slots=seqs)
    return Scheduler(SchedulerConfig(seqs, budget, max_len), kv)


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(n)), SamplingParams(temperature=0), max_tokens=max_tokens)


def test_slots_taken_released_and_copied():
    s = StateSlots(2)
    assert s.take("a") == 0 and s.take("a") == 0 and s.take("b") == 1 and s.take("c") is None
    assert s.copy("a", "c") is False  # no slot free
    s.release("b")
    assert s.copy("a", "c") and s.get("c") == 1 and s.take_copies() == [(0, 1)]
    assert s.take_copies() == []
    s.copy("c", "d")  # no slot: nothing recorded
    s.release("c")
    assert s.take_copies() == [] and s.num_free == 1
    with pytest.raises(ValueError, match="at least 1"):
        StateSlots(0)


def test_slot_follows_the_request_and_caching_is_off():
    s = make()
    assert not s.kv.enable_caching  # a cached prefix would come without its state
    a, b = req("a", 6), req("b", 6)
    s.add_request(a)
    s.add_request(b)
    step(s)
    slots = {s.kv.get_state_slot(a), s.kv.get_state_slot(b)}
    assert slots == {0, 1}
    s._preempt(b)
    assert s.kv.get_state_slot(b) is None and s.kv.states.num_free == 3
    while s.has_unfinished():
        step(s)
    assert a.finished and b.finished and s.kv.states.num_free == 4


@pytest.mark.parametrize("prompt", [9, 12, 13])
def test_fork_pauses_the_prompt_at_the_shared_point_and_copies_its_state(prompt):
    s = make()
    parent, child = req("p", prompt), req("c", prompt)
    child.fork_of = parent
    s.add_request(parent)
    s.add_request(child)
    point = (prompt - 1) // BS * BS
    out = step(s)
    assert out.requests == [parent] and out.num_scheduled_tokens["p"] == point
    out = step(s)  # the parent goes on; the child starts from the shared point, with its state
    assert out.requests == [parent, child]
    assert child.status is RequestStatus.RUNNING
    assert out.num_scheduled_tokens["c"] == prompt - point
    assert out.state_copies == [(s.kv.get_state_slot(parent), s.kv.get_state_slot(child))]
    assert s.kv.get_block_ids(child)[: point // BS] == s.kv.get_block_ids(parent)[: point // BS]


def test_fork_past_the_point_recomputes_its_prompt():
    """A sibling that could not be admitted at the point (no sequence free) shares nothing."""
    s = make(seqs=2)
    other, parent, child = req("o", 3, max_tokens=20), req("p", 9), req("c", 9)
    child.fork_of = parent
    for r in (other, parent, child):
        s.add_request(r)
    step(s)  # other + parent (paused at 8); the child waits: two sequences at most
    step(s)
    while not child.num_computed_tokens and s.has_unfinished():
        out = step(s)
    assert parent.num_computed_tokens > 8
    assert child.num_computed_tokens in (9, 10)  # its whole prompt, computed by itself
    assert out.state_copies == []
