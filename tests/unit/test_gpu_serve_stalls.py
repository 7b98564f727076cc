"""The longest engine step of each worker in a run, from the step histogram's buckets read
before and after it (`bench/gpu_serve_stalls.py`). Pure."""

from __future__ import annotations

from bench.gpu_serve_stalls import (
    first_token_table,
    longest_bucket,
    longest_first_token_waits,
    longest_label,
    longest_steps,
    parse_step_buckets,
)
from bench.gpu_serve_steps import kinds_table, run_steps

BOUNDS = ("0.004", "0.008", "0.25", "0.5", "+Inf")


def histogram(worker: str, kind: str, batch: str, per_bucket: tuple[int, ...]) -> str:
    """Cumulative `_bucket` lines (prometheus_client's order of labels), `per_bucket` steps in each."""
    out, total = "", 0
    for le, n in zip(BOUNDS, per_bucket):
        total += n
        out += f'pdserve_engine_step_seconds_bucket{{batch="{batch}",kind="{kind}",le="{le}",role="decode",worker="{worker}"}} {total}\n'
    return out


def test_the_longest_step_is_the_highest_bucket_that_gained_steps_in_the_run():
    before = histogram("decode-0", "decode", "33-64", (100, 50, 0, 0, 0)) + histogram("decode-0", "decode", "9-16", (10, 0, 0, 0, 0))
    # One decode step of 250-500 ms in the run, in another batch bucket than most: batch buckets add up.
    after = histogram("decode-0", "decode", "33-64", (300, 90, 0, 0, 0)) + histogram("decode-0", "decode", "9-16", (12, 0, 0, 1, 0))
    assert longest_steps(before, after) == {"decode-0": {"decode": {"at_most_ms": 500.0}}}
    assert longest_steps(after, after) == {}  # no step in between
    # The stall came before this run: not its longest step.
    later = histogram("decode-0", "decode", "33-64", (400, 95, 0, 0, 0)) + histogram("decode-0", "decode", "9-16", (12, 0, 0, 1, 0))
    assert longest_steps(after, later) == {"decode-0": {"decode": {"at_most_ms": 8.0}}}


def test_a_step_past_the_last_bound_and_a_restarted_worker():
    past = histogram("prefill-0", "prefill", "1", (0, 0, 3, 0, 1))
    assert longest_steps("", past) == {"prefill-0": {"prefill": {"over_ms": 500.0}}}
    assert longest_label({"over_ms": 500.0}) == "> 500 ms" and longest_label({"at_most_ms": 8.0}) == "≤ 8 ms"
    assert longest_label(None) == "-"
    # Counts went backwards (the worker restarted): the run's figures count from zero.
    assert longest_bucket({0.004: 900.0, 0.008: 950.0, float("inf"): 950.0}, {0.004: 5.0, 0.008: 5.0, float("inf"): 5.0}) == (0.0, 0.004)
    assert longest_bucket({0.004: 5.0}, {0.004: 5.0}) is None
    assert parse_step_buckets("pdserve_engine_step_seconds_count{worker=\"d\"} 3\n") == {}


def test_the_kinds_table_gives_each_workers_longest_step_by_kind():
    rec = run_steps("", "")
    rec["decode"] = {"decode-0": {"all": {"steps": 10, "mean_step_ms": 6.0, "mean_batch": 40.0}}}
    rec["longest"] = {"decode-0": {"decode": {"at_most_ms": 500.0}}}
    table = kinds_table([{"server": "pdserve-colocated", "workload": "chat", "rate": 96.0, "engine_steps": rec}])
    row = next(line for line in table.splitlines() if "decode-0" in line)
    assert [c.strip() for c in row.strip(" |").split("|")][-1] == "≤ 500 ms / - / -", table


def router_histogram(name: str, per_bucket: tuple[int, ...], part: str = "") -> str:
    out, total = "", 0
    for le, n in zip(BOUNDS, per_bucket):
        total += n
        label = f'le="{le}"' + (f',part="{part}"' if part else "")
        out += f"{name}_bucket{{{label}}} {total}\n"
    return out


def test_the_router_s_longest_first_token_waits_place_a_stall_in_the_submit_call():
    ttft, call, submit = (
        "pdserve_time_to_first_token_seconds", "pdserve_prefill_duration_seconds", "pdserve_local_prefill_submit_seconds"
    )
    before = router_histogram(ttft, (10, 0, 0, 0, 0)) + router_histogram(call, (10, 0, 0, 0, 0))
    # In the run: one first token of 250-500 ms, its prefill call as long, and its submit call too.
    after = (
        router_histogram(ttft, (300, 50, 0, 1, 0)) + router_histogram(call, (300, 50, 0, 1, 0))
        + router_histogram(submit, (350, 0, 0, 1, 0), "call") + router_histogram(submit, (351, 0, 0, 0, 0), "send")
        + router_histogram(submit, (350, 0, 1, 0, 0), "worker") + router_histogram(submit, (350, 0, 0, 1, 0), "reply")
        + router_histogram("pdserve_other_seconds", (0, 0, 0, 0, 9))
    )
    waits = longest_first_token_waits(before, after)
    assert waits == {key: {"at_most_ms": 500.0} for key in ("ttft", "prefill_call", "submit_call", "submit_reply")} | {
        "submit_send": {"at_most_ms": 4.0}, "submit_worker": {"at_most_ms": 250.0}}
    assert longest_first_token_waits(after, after) == {}

    rec = run_steps("", "")
    rec["first_token_longest"] = waits
    rec["longest"] = {"decode-0": {"decode": {"at_most_ms": 8.0}, "mixed": {"at_most_ms": 16.0}}, "decode-1": {"decode": {"at_most_ms": 4.0}}}
    run = {"server": "pdserve-colocated", "workload": "chat", "rate": 96.0, "engine_steps": rec,
           "timeline": [[0.0, 20.0, 300.0, 10], [0.1, 315.2, 600.0, 10], [0.2, None, 5.0, 0]]}
    table = first_token_table([run])
    row = next(line for line in table.splitlines() if "pdserve-colocated" in line)
    # The engine's longest step was 16 ms: the stall was in the call that queues the prompt, on its way back.
    assert [c.strip() for c in row.strip(" |").split("|")][3:] == [
        "315", "≤ 500 ms", "≤ 500 ms", "≤ 500 ms / ≤ 4 ms / ≤ 250 ms / ≤ 500 ms", "≤ 16 ms"]
    assert first_token_table([{**run, "engine_steps": run_steps("", "")}]) == ""  # a run without them
