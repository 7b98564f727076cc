"""The router's gRPC and HTTP servers in this process, over a router whose workers are the
in-memory doubles of `router_doubles` (a decode worker that emits token 7 once per poll): the
edge exercised end to end, with no worker processes. Also a small byte-level BPE tokenizer, for
tests that need real tokenization."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve.router.edge.http_server import start_http_server
from pdserve.router.router import Router
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from pdserve_proto import worker_pb2
from tests.unit.router_doubles import FakeDecode, make_router

DOUBLE_TOKEN = 7  # what FakeDecode emits, every step


class OnePollDecode(FakeDecode):
    """A decode double that emits every token a request has left in one poll (one update per
    token, as a worker's batched steps arrive), so that a request for thousands is quick."""

    async def poll(self, wait_s, timeout_s, acked=None) -> worker_pb2.TokenUpdates:
        await asyncio.sleep(0.002)
        out = worker_pb2.TokenUpdates()
        for rid, left in list(self.live.items()):
            for i in range(left):
                out.updates.add(request_id=rid, token_ids=[DOUBLE_TOKEN], finish_reason="length" if i == left - 1 else "")
            del self.live[rid]
        return out


@dataclass
class Served:
    router: Router
    decode: FakeDecode
    grpc_port: int
    http_port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def generate_ids(self, channel: grpc.aio.Channel, max_tokens: int = 4) -> list[int]:
        """A greedy request over gRPC: the token ids it streamed."""
        req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0))
        return [t async for chunk in pbg.InferenceStub(channel).Generate(req, timeout=10) for t in chunk.token_ids]


@contextlib.asynccontextmanager
async def served(tokenizer: Any = None, decode: FakeDecode | None = None, **overrides: Any) -> AsyncIterator[Served]:
    decode = decode if decode is not None else FakeDecode()
    router = make_router([], [decode], **overrides)
    if tokenizer is not None:
        router = Router(router.config, tokenizer, [], [decode])
    await router.start()
    grpc_server, grpc_port = await start_grpc_server(router, "127.0.0.1", 0)
    runner, http_port = await start_http_server(router, "127.0.0.1", 0)
    try:
        yield Served(router, decode, grpc_port, http_port)
    finally:
        await runner.cleanup()
        await grpc_server.stop(0)
        await router.stop()


def small_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of 300 tokens trained on a line of English, as Hugging Face loads one."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    return tokenizer
