"""Scheduler decisions, without a model: budgets, chunking, prefix hits, preemption, roles."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerLimits, decodes
from pdserve.engine.sequence import Sequence, SeqStatus


def make(num_blocks=32, block_size=4, max_seqs=8, budget=64, role="both", max_len=256):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerLimits(max_seqs, budget, max_len, role), bm, eos_token_ids=(0,)), bm


def seq(rid, n, arrival, max_tokens=8, **kw):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), arrival)


def run_step(s: Scheduler, token: int = 5):
    batch = s.schedule()
    s.update(batch, {item.seq.request_id: token for item in batch if item.sample})
    return batch


def test_long_prompt_is_chunked_by_the_token_budget():
    s, bm = make(budget=10)
    a = seq("a", 25, 0)
    s.add(a)
    sizes = [b[0].num_new_tokens for b in (run_step(s), run_step(s), run_step(s))]
    assert sizes == [10, 10, 5]
    assert a.num_output_tokens == 1  # only the last chunk samples
    assert len(a.block_ids) == bm.blocks_needed(a.num_computed_tokens)


def test_decodes_are_scheduled_before_new_prefills():
    s, _ = make(budget=12)
    a = seq("a", 4, 0)
    s.add(a)
    run_step(s)
    s.add(seq("b", 30, 1))
    batch = run_step(s)
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 11)]


def test_newest_sequence_is_preempted_when_blocks_run_out_and_recomputes():
    s, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7, 0, max_tokens=20), seq("b", 7, 1, max_tokens=20)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    for _ in range(2):
        run_step(s)  # a needs a third block at 9 tokens -> b (newest) is preempted
    assert s.num_preemptions >= 1 and b.status is SeqStatus.WAITING and b.block_ids == []
    assert b.num_computed_tokens == 0 and b.num_output_tokens >= 1  # its generated tokens are kept
    bm.check_integrity()


def test_prefix_hit_skips_cached_blocks_but_never_the_last_token():
    s, bm = make(block_size=4)
    a = seq("a", 12, 0, max_tokens=1)
    s.add(a)
    run_step(s)
    assert a.status is SeqStatus.FINISHED
    b = seq("b", 12, 1, max_tokens=1)
    s.add(b)
    batch = run_step(s)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks (8 tokens) are hits.
    assert b.num_cached_tokens == 8 and batch[0].num_new_tokens == 4
    assert bm.check_integrity().in_use == 0


def test_admission_stops_at_max_num_seqs():
    s, _ = make(max_seqs=2)
    for i in range(3):
        s.add(seq(str(i), 3, i))
    assert len(run_step(s)) == 2 and len(s.waiting) == 1


def test_prefill_role_pins_blocks_until_released():
    s, bm = make(role="prefill")
    a = seq("a", 9, 0, max_tokens=50)
    s.add(a)
    run_step(s)
    assert a.status is SeqStatus.PINNED and a.num_output_tokens == 1 and a.finish_reason is None
    assert bm.stats().in_use == 3 and not s.has_work()
    assert s.release_pinned("a") and bm.check_integrity().in_use == 0
    assert not s.release_pinned("a")


def test_stop_conditions():
    s, _ = make()
    a, b, c = seq("a", 3, 0, max_tokens=2), seq("b", 3, 1), seq("c", 3, 2, stop_token_ids=(5,))
    for x in (a, b, c):
        s.add(x)
    s.update(s.schedule(), {"a": 7, "b": 0, "c": 5})
    assert b.finish_reason == "stop"  # eos
    assert c.finish_reason == "stop"  # stop token id
    assert a.finish_reason is None
    run_step(s, token=7)
    assert a.finish_reason == "length"


def test_sequence_that_cannot_fit_even_alone_finishes_with_length():
    s, bm = make(num_blocks=2, block_size=4, max_len=1000)
    a = seq("a", 7, 0, max_tokens=100)
    s.add(a)
    for _ in range(5):
        run_step(s)
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "length"
    assert bm.check_integrity().in_use == 0


def test_prompt_tokens_beside_decodes_are_capped_and_a_prompt_alone_is_not():
    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerLimits(8, 64, 256, "both", max_prefill_tokens_with_decodes=5), bm, eos_token_ids=(0,))
    b = seq("b", 30, 0)
    s.add(b)
    assert [(i.seq.request_id, i.num_new_tokens) for i in run_step(s)] == [("b", 30)]  # nothing decodes yet
    c = Sequence("c", list(range(100, 123)), SamplingParams(max_tokens=8, temperature=0.0), 1)  # no prefix of b
    s.add(c)
    steps = [[(i.seq.request_id, i.num_new_tokens) for i in run_step(s)] for _ in range(6)]
    # b decodes one token a step; c's prompt goes in at most 5 tokens a step beside it.
    assert steps[:5] == [[("b", 1), ("c", 5)]] * 4 + [[("b", 1), ("c", 3)]]
    assert steps[5] == [("b", 1), ("c", 1)]  # c decodes too now
    assert b.num_output_tokens == 7 and c.num_output_tokens == 2
    bm.check_integrity()


def test_a_chunked_prompt_already_running_is_capped_once_a_sequence_decodes():
    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerLimits(8, 16, 256, "both", max_prefill_tokens_with_decodes=3), bm, eos_token_ids=(0,))
    a, b = seq("a", 2, 0), seq("b", 40, 1)
    s.add(a)
    s.add(b)
    assert [(i.seq.request_id, i.num_new_tokens) for i in run_step(s)] == [("a", 2), ("b", 14)]
    assert [(i.seq.request_id, i.num_new_tokens) for i in run_step(s)] == [("a", 1), ("b", 3)]
    uncapped = Scheduler(SchedulerLimits(8, 16, 256), BlockManager(8, 4), eos_token_ids=(0,))
    uncapped.running.append(a)
    assert uncapped.prompt_room() is None and decodes(a)  # no cap set: the budget
