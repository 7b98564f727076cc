"""bench/tp_step.py in its CPU form (tiny shape, gloo, the smallest settings): every step it
measures has a row at TP1 and TP2 with positive times and floors, the TP2 rows a collective floor
measured over two ranks, and TP2's greedy tokens agree with TP1's; plus the agreement rule on
made-up logits, and the per-rank byte count it holds decode steps against."""

from __future__ import annotations

import json

import pytest
import torch

from bench import tp_step


def test_the_cpu_run_has_every_row_with_positive_numbers_and_tp2_agrees(tmp_path, capsys) -> None:
    out = tmp_path / "tp.json"
    argv = [
        "--device", "cpu", "--shapes", "tiny", "--batches", "1,2", "--context", "8", "--prefill-tokens", "16",
        "--decode-warmup", "1", "--decode-reps", "2", "--prefill-warmup", "1", "--prefill-reps", "2",
        "--max-new", "4", "--prompt-lengths", "1,9,20", "--model-dir", str(tmp_path), "--json", str(out),
    ]  # fmt: skip
    assert tp_step.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["width"], r["metric"].split(", ctx")[0]): r for r in result["rows"]}
    steps = ["decode batch 1", "decode batch 2", "prefill 16 tokens"]
    assert sorted(rows) == sorted((w, m) for w in (1, 2) for m in steps)
    for (width, metric), r in rows.items():
        assert r["median_s"] > 0 and r["device_floor_s"] > 0, r
        assert (r["collective_floor_s"] > 0) == (width == 2), r  # measured over the two ranks only
        assert (r["steady_s"] is not None and r["steady_s"] > 0) == metric.startswith("decode"), r
    assert [a["ok"] for a in result["agreement"]["tiny"]] == [True] * 3
    printed = capsys.readouterr()
    table = printed.out
    assert table.count("| tiny  |") == 6 and "TP2 vs TP1 greedy: 3 of 3 prompts token for token" in table
    # The yardstick: TP1 (float32 on CPU) against the float32 reference's own greedy tokens.
    assert [a["ok"] for a in result["info"]["tiny"]["tp1_vs_fp32"]] == [True] * 3
    assert "tiny: TP1 vs the fp32 reference's greedy: " in table and "TP2 vs TP1 -, TP1 vs fp32" in table
    # Each row was said as its engine finished, before the agreement check.
    progress = [line for line in printed.err.splitlines() if line.startswith("tp_step: tiny TP")]
    assert len(progress) == 6 and progress[0].startswith("tp_step: tiny TP1 cpu decode batch 1")


def test_agreement_is_equal_or_a_first_difference_at_a_near_tie() -> None:
    logits = torch.zeros(10)
    logits[3], logits[4], logits[5] = 8.0, 7.99, 6.0  # 4 ulps of 8 in bf16: 0.25

    def reference(ids: list[int]) -> torch.Tensor:
        return logits

    got = tp_step.agreement(reference, [[1], [1], [1]], [[3, 3], [3, 4], [3, 5]], [[3, 3], [3, 3], [3, 3]])
    assert [(a.first_diff, a.ok) for a in got] == [(None, True), (1, True), (1, False)]
    assert got[2].gap == pytest.approx(2.0) and got[2].tolerance == pytest.approx(0.25)
    assert not any(a.takes_reference for a in got)


def test_a_parting_past_a_near_tie_passes_only_where_tp2_takes_the_fp32_token() -> None:
    """TP1 (bf16) itself parts from float32 past the near-tie rule on the 8B shape; where TP2 then
    keeps float32's token, TP1 is the one that strayed, and TP2 passes."""
    logits = torch.zeros(10)
    logits[3], logits[5] = 8.0, 6.0

    def reference(ids: list[int]) -> torch.Tensor:
        return logits

    kept, strayed = tp_step.agreement(reference, [[1], [1]], [[3, 3], [3, 5]], [[3, 5], [3, 3]])
    assert (kept.first_diff, kept.gap, kept.takes_reference, kept.ok) == (1, pytest.approx(2.0), True, True)
    assert (strayed.takes_reference, strayed.ok) == (False, False)
    line = tp_step.format_agreement("8b", [kept, strayed])
    assert "NOT a near-tie; TP2 takes fp32's token" in line and "NOT every other at a near-tie or fp32's token" in line


def test_a_tp2_rank_reads_half_the_8b_layers_and_its_kv_heads_only() -> None:
    cfg = tp_step.TP_SHAPES["8b"]
    one = tp_step.rank_step_bytes(tp_step.rank_configs(cfg, 1)[0], 0, 2)
    halves = [tp_step.rank_step_bytes(p, 0, 2) for p in tp_step.rank_configs(cfg, 2)]
    assert halves[0] == halves[1] and one / 2 < halves[0] < one / 2 * 1.001  # norms are whole on each rank
    kv = tp_step.rank_step_bytes(tp_step.rank_configs(cfg, 2)[0], 1000, 2) - halves[0]
    assert kv == 1000 * 32 * 2 * 4 * 128 * 2  # 4 of the 8 KV heads


def test_the_fp32_reference_greedy_equals_the_engines_float32_greedy(tmp_path) -> None:
    """`Fp32Reference.greedy` (transformers, float32) gives the float32 engine's greedy tokens on
    the tiny shape, end-of-sequence ignored by both."""
    from pdserve import LLM, SamplingParams

    out = tmp_path / "m"
    tp_step.write_model(out, tp_step.TP_SHAPES["tiny"], 0, "cpu", torch.float32)
    ref = tp_step.Fp32Reference(str(out), "cpu")
    prompts = [[5, 17, 3], [9] * 20]
    llm = LLM(str(out), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert [ref.greedy(p, 6) for p in prompts] == want


def test_the_baseline_line_names_the_widest_gap_of_each_pair() -> None:
    A = tp_step.Agreement
    tp2 = [A(1), A(7, 2, 0.17, 0.125), A(9, 0, 0.05, 0.125)]
    tp1 = [A(1, 3, 0.21, 0.125), A(7), A(9)]
    line = tp_step.format_baseline("8b", tp2, tp1)
    assert line == (
        "8b: TP1 vs the fp32 reference's greedy: 2 of 3 prompts token for token, 1 part past a near-tie; "
        "widest gap where they first part: TP2 vs TP1 0.1700, TP1 vs fp32 0.2100"
    )
