"""A decode engine that is handed more prompts than `max_num_seqs` (hand-overs arrive while its
batch is full) runs at most `max_num_seqs` of them a step; the rest wait in `ready`, holding
their blocks, and join as places free up, with exactly the tokens of a colocated run. Before,
the extra imports went straight into the running batch, and a step one wider than the engine's
buffers crashed its loop."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.hashing import block_hashes

MAX_SEQS = 2
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prefill(engine: LLMEngine, ids: list[int], rid: str):
    engine.add_request(ids, PARAMS, rid)
    while rid not in engine.scheduler.pinned:
        engine.step()
    return engine.pinned_kv(rid)


def test_imports_past_max_num_seqs_wait_for_a_place_and_decode_exactly(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    vocab = hf_model.config.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(9 + 5 * i)] for i in range(5)]
    want = [o.token_ids for o in LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128).generate(prompts, PARAMS)]

    options = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 128, "block_size": 4, "max_num_seqs": MAX_SEQS}
    producer = LLM(str(model_dir), role="prefill", **options).engine
    decoder = LLM(str(model_dir), role="decode", **options).engine
    check_blocks_freed(producer)
    check_blocks_freed(decoder)
    widths: list[int] = []
    execute, launch = decoder.runner.execute, decoder.runner.launch
    decoder.runner.execute = lambda scheduled, *rest: (widths.append(len(scheduled)), execute(scheduled, *rest))[1]
    decoder.runner.launch = lambda scheduled, *a, **k: (widths.append(len(scheduled)), launch(scheduled, *a, **k))[1]

    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):  # all five handed over before the decoder takes a step
        rid = f"r{i}"
        pinned = _prefill(producer, ids, rid)
        plan = decoder.begin_import(ids, PARAMS, rid, block_hashes(ids, 4))
        for j in plan.pull_indices:  # what the KV transfer's READ does, block by block
            decoder.runner.kv_pool[plan.block_ids[j]] = producer.runner.kv_pool[pinned.block_ids[j]]
        decoder.commit_import(rid, pinned.first_token)
        producer.release(rid)
        tokens[rid] = [pinned.first_token]
    assert len(decoder.scheduler.running) == MAX_SEQS and len(decoder.scheduler.ready) == len(prompts) - MAX_SEQS
    assert decoder.load_stats()["waiting_requests"] == len(prompts) - MAX_SEQS

    finished = set()
    while decoder.has_unfinished():
        for out in decoder.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    assert finished == set(tokens)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == want
    assert widths and max(widths) == MAX_SEQS


def test_an_aborted_import_that_waits_for_a_place_frees_its_blocks(tiny_model_factory, check_blocks_freed):
    model_dir, _ = tiny_model_factory("llama")
    options = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 1}
    decoder = LLM(str(model_dir), role="decode", **options).engine
    check_blocks_freed(decoder)
    for i in range(3):
        ids = list(range(1 + i, 10 + i))
        decoder.begin_import(ids, PARAMS, f"r{i}", block_hashes(ids, 4))
        decoder.commit_import(f"r{i}", 5)
    assert [s.request_id for s in decoder.scheduler.ready] == ["r1", "r2"]
    assert decoder.abort("r2") and decoder.scheduler.find("r2") is None
    assert decoder.scheduler.find("r1") is not None
    while decoder.has_unfinished():
        decoder.step()
