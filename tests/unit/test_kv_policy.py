"""Pure parts of the KV path: descriptor coalescing, leases, compat hashes, handle checks, notices."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.compat import PROTOCOL_VERSION, KvCompatError, KvLayout, check_compatible, check_handle
from pdserve.kv_transfer.descriptors import coalesce, split_large
from pdserve.kv_transfer.notice import pulled_notice, pulled_request
from pdserve.prefill_worker.leases import LeaseTable
from pdserve_proto import kv_pb2


def test_coalesce_merges_runs_contiguous_on_both_sides():
    assert coalesce([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert coalesce([1, 2], [7, 9]) == [(1, 7, 1), (2, 9, 1)]  # local side breaks the run
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="differ in length"):
        coalesce([1], [])


def test_split_large_caps_descriptor_size():
    assert split_large([(0, 100, 5)], 2) == [(0, 100, 2), (2, 102, 2), (4, 104, 1)]


def test_leases_expire_in_order_and_end_once():
    t = LeaseTable()
    t.grant("a", 10.0)
    t.grant("b", 20.0)
    assert t.expired(9.9) == []
    assert t.expired(10.0) == ["a"]
    assert "a" not in t and t.end("b") and not t.end("b") and len(t) == 0


def test_compat_hash_covers_every_layout_field():
    base = KvLayout("m", "bfloat16", 32, 8, 128, 16, hash_version=1)
    variants = [
        KvLayout("other", "bfloat16", 32, 8, 128, 16, hash_version=1),
        KvLayout("m", "float16", 32, 8, 128, 16, hash_version=1),
        KvLayout("m", "bfloat16", 16, 8, 128, 16, hash_version=1),
        KvLayout("m", "bfloat16", 32, 4, 128, 16, hash_version=1),
        KvLayout("m", "bfloat16", 32, 8, 64, 16, hash_version=1),
        KvLayout("m", "bfloat16", 32, 8, 128, 32, hash_version=1),
        KvLayout("m", "bfloat16", 32, 8, 128, 16, hash_version=1, layout="layer-major"),
        KvLayout("m", "bfloat16", 32, 8, 128, 16, hash_version=1, protocol_version=99),
        KvLayout("m", "bfloat16", 32, 8, 128, 16, hash_version=2),
    ]
    assert len({v.compat_hash() for v in variants} | {base.compat_hash()}) == len(variants) + 1
    with pytest.raises(KvCompatError, match="compat_hash"):
        check_compatible(base.compat_hash(), variants[0].compat_hash(), "p0")
    assert base.block_bytes == 32 * 2 * 16 * 8 * 128 * 2


def test_a_handle_of_another_protocol_or_layout_is_refused_naming_the_field():
    ok = KvLayout("m", "float32", 2, 2, 8, 16, hash_version=1).compat_hash()

    def handle(version: int, compat_hash: str) -> kv_pb2.KvHandle:
        return kv_pb2.KvHandle(protocol_version=version, request_id="r", worker_id="p0", compat_hash=compat_hash)

    check_handle(handle(PROTOCOL_VERSION, ok), ok)
    with pytest.raises(KvCompatError, match="^protocol_version: the KV handle of r from 'p0'"):
        check_handle(handle(PROTOCOL_VERSION + 1, ok), ok)
    other = KvLayout("m", "float32", 2, 2, 8, 32, hash_version=1).compat_hash()
    with pytest.raises(KvCompatError, match="^compat_hash: worker 'p0'"):
        check_handle(handle(PROTOCOL_VERSION, other), ok)


def test_the_pulled_notice_round_trips_and_other_notices_are_not_pulls():
    assert pulled_request(pulled_notice("req-7")) == "req-7"
    assert pulled_request(b"") is None and pulled_request(b"hello") is None
