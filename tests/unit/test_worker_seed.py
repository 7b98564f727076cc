"""A seed anywhere in the public API's range, [0, 2^64), reaches the worker as it was sent: the
worker calls' field is unsigned too (a signed one refused seeds from 2^63 on, which `n` choices
reach by seed + i)."""

from __future__ import annotations

import pytest

from pdserve.cluster.worker_boundary import sampling_params_of
from pdserve.engine.sampling_params import MAX_SEED, SamplingParams
from pdserve.router.calls import worker_params
from pdserve_proto import worker_pb2


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, 2**63, MAX_SEED])
def test_seed_crosses_the_worker_call_unchanged(seed):
    sent = worker_params(SamplingParams(seed=seed)).SerializeToString()
    assert sampling_params_of(worker_pb2.WorkerSamplingParams.FromString(sent)).seed == seed


def test_no_seed_stays_unset():
    sent = worker_params(SamplingParams()).SerializeToString()
    assert sampling_params_of(worker_pb2.WorkerSamplingParams.FromString(sent)).seed is None
