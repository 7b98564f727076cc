"""Runs fault scenarios (tests/faults/scenarios.py) against a real cluster in this process: real
engines on a tiny random-weight model, real NIXL transfers between them, two real routers, each
behind its own real gRPC server, and clients calling them over gRPC. One cluster serves every
scenario; a worker killed by a scenario is replaced afterwards through each router's add-worker
path, as an operator would add one back, and a killed router by a new one.

The two routers are replicas as `pdserve router --address` makes them (pdserve/cluster/join.py):
each has its own id and its own clients of every worker, so each decode worker keeps an outbox
and a lease per router. A router dies as a SIGKILL would have it: from that moment none of its
calls reaches a worker, its clients' connections are reset (they get UNAVAILABLE; see
tests/faults/severable_link.py), its gRPC server and its tasks stop;
what it had started on the workers is left to their leases.

Faults come in through seams, each a test double and said so: the router's client of each
worker (`Tap`: kills its worker at a chosen call of a chosen request, delays its token polls),
each decode worker's KV transport (tests/cluster/transport_double.py: failed, dropped, slow
and corrupted READs, and READs from a dead peer), the prefill workers' lease, and the clients themselves
(cancel mid-stream). A killed worker's engine stops and every call to it, in flight or later,
fails at once as a dead Ray actor's does."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from pdserve import LLM, SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.worker_boundary import local_worker
from pdserve.cluster.worker_client import WorkerClient, WorkerUnreachable, new_router_id
from pdserve.cluster.workers import build_decode, build_prefill
from pdserve.engine.args import EngineArgs
from pdserve.engine.config import ModelConfig
from pdserve.engine.detokenizer import load_tokenizer
from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve.router.handles import RouterError
from pdserve.router.membership import MembershipConfig
from pdserve.router.router import Router, RouterConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from pdserve_proto import worker_pb2
from tests.cluster.transport_double import FaultyTransport
from tests.faults.invariants import Outcome, Reference, check_scenario
from tests.faults.scenarios import KILLS, ROUTER_DIES, ROUTERS, RequestSpec, Scenario, router_of
from tests.faults.severable_link import SeverableLink
from tests.tiny_models import build_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BLOCKS_FREE_S = 5.0  # once idle, every block must be free within this (plus a short lease's length)
NORMAL_LEASE_S = 10.0
# The decode workers' lease on each router: a dead router's requests are aborted this long after
# its last poll (a server's is 15 s; short here so that scenarios stay short). Live routers poll
# every few tens of milliseconds.
ROUTER_LEASE_S = 2.0


def make_tiny_model(out_dir: Path) -> Path:
    """The tiny random-weight llama of tests/tiny_models.py, with the default model's tokenizer
    beside it (its first 384 ids are the tiny vocabulary), so streams carry real text."""
    from pdserve.models.default_model import default_model_dir

    if not (out_dir / "config.json").is_file():
        build_tiny_model("llama", out_dir)
        for name in TOKENIZER_FILES:
            shutil.copy(default_model_dir() / name, out_dir / name)
    return out_dir


class LoopThread:
    """An asyncio loop on a thread. Its thread pool is large: every call to an in-process
    worker runs on it, and a killed worker's calls may hold a thread until their deadline."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="fault-calls")
        self.loop.set_default_executor(self._pool)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fault-loop")
        self._thread.start()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def call(self, fn: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        # Idle threads end now, one still in a call when that call returns: a recycled cluster's
        # pool would otherwise stay behind for the rest of the run.
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.loop.close()


class Tap:
    """Fault injection: one router's client of one worker. Fires the kill the cluster armed for
    (method, request id) once, and delays token polls while the worker is slow. A router death
    armed for the call fires before it (the call never leaves) or once it has answered (the
    answer reaches nobody): the router's handling of the request stops there for good."""

    def __init__(self, client: WorkerClient, cluster: FaultCluster, replica: RouterReplica) -> None:
        self.client = client
        self.cluster = cluster
        self.replica = replica
        self.worker_id = client.worker_id

    async def _router_dies(self, method: str, request_id: str, when: str) -> None:
        fault = self.cluster.armed_router_kills.pop((method, request_id, when), None)
        if fault is not None and self.cluster.kill_router(self.replica, fault):
            await asyncio.Event().wait()  # frozen: the server's stop cancels this request's task

    async def _tapped(self, method: str, request_id: str, *args: Any, **kwargs: Any) -> Any:
        await self._router_dies(method, request_id, "before")
        when, fault = self.cluster.armed_kills.pop((method, request_id), (None, None))
        if when == "before":
            self.cluster.kill(self.worker_id, fault)
        result = await getattr(self.client, method)(*args, **kwargs)
        await self._router_dies(method, request_id, "after")
        if when is not None and when != "before":
            self.cluster.kill(self.worker_id, fault)
            if when == "during":  # it did the work, but its answer died with it
                raise RouterError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{method}: ActorDiedError: {self.worker_id} was killed by the test",
                    worker_failed=True,
                )
        return result

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> Any:
        return await self._tapped("prefill", request.request_id, request, timeout_s)

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> Any:
        return await self._tapped("start", request.request_id, request, timeout_s)

    async def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> Any:
        return await self._tapped("submit", request.request_id, request, timeout_s)

    async def poll(self, *args: Any, **kwargs: Any) -> Any:
        delay = self.cluster.poll_delay_s.get(self.worker_id, 0.0)
        if delay:
            await asyncio.sleep(delay)
        return await self.client.poll(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class _Severable:
    """One router's transport to one worker: every call fails as Ray's would once the router or
    the worker is dead, or when the worker dies while the call is in flight; a poll's answer can
    be held back (`late_polls`)."""

    def __init__(self, cluster: FaultCluster, worker: Any, replica: RouterReplica) -> None:
        self._cluster, self._replica = cluster, replica
        self._worker = local_worker(worker)
        self._wid = worker.worker_id

    def __getattr__(self, call: str) -> Any:
        method = getattr(self._worker, call)
        cluster, replica, wid = self._cluster, self._replica, self._wid

        async def severable(request: Any) -> Any:
            if replica.dead:  # a dead router sends nothing
                raise WorkerUnreachable(f"router {replica.router_id} was killed by the test; {call} not sent")
            killed = cluster._killed.setdefault(wid, asyncio.Event())
            if wid in cluster.dead:
                raise WorkerUnreachable(f"ActorDiedError: {wid} was killed by the test")
            work = asyncio.ensure_future(method(request))
            death = asyncio.ensure_future(killed.wait())
            try:
                await asyncio.wait({work, death}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                death.cancel()
            if not work.done():  # killed while the call was in flight: it fails as Ray's would
                work.cancel()
                raise WorkerUnreachable(f"ActorDiedError: {wid} was killed by the test during {call}")
            late = cluster.late_polls.pop(wid, 0.0) if call == "poll" else 0.0
            if late:  # the worker has answered (its outbox is drained), the answer travels slowly
                await asyncio.sleep(late)
            return work.result()

        return severable


class MortalRouter(Router):
    """A router that can die as under SIGKILL (`dead`): from then on no chunk and no status of
    any request leaves it, so each call in flight ends UNAVAILABLE when its connection is reset
    (a status decided just after the death, before the reset reached its call, would otherwise
    get out, which a killed process never sends). Records the requests it ended while alive:
    their status is the router's own, and the invariants judge it as such (or as lost with the
    connection, if it had not reached the client when the router died)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dead = False
        self.ended_alive: set[str] = set()  # request ids

    async def generate(self, request: pb.GenerateRequest, *args: Any, **kwargs: Any) -> Any:
        try:
            async for chunk in super().generate(request, *args, **kwargs):
                if self.dead:
                    await _forever()
                yield chunk
            if self.dead:
                await _forever()
        except Exception:
            if self.dead:
                await _forever()
            raise
        finally:
            if not self.dead:
                self.ended_alive.add(request.request_id)


async def _forever() -> None:
    """Until cancelled (the dead router's server stops its calls)."""
    await asyncio.Event().wait()


@dataclass
class RouterReplica:
    """One router of the cluster: its own id, its clients of every worker, its gRPC server and a
    channel to it. `dead` once killed: its invokers refuse every call from then on."""

    slot: int  # which requests it serves: those with router_of(i) == slot
    router_id: str
    router: MortalRouter | None = None
    server: Any = None
    channel: grpc.Channel | None = None
    stub: pbg.InferenceStub | None = None
    admin: pbg.AdminStub | None = None
    dead: bool = False
    stopped: Future | None = None  # its server's and tasks' stop, once killed
    link: SeverableLink | None = None  # between its clients and its server: cut when it dies


@dataclass
class ScenarioResult:
    scenario: Scenario
    outcomes: list[Outcome]
    references: list[Reference]
    fired: dict[int, float] = field(default_factory=dict)  # fault index -> when it fired (monotonic)
    violations: list[str] = field(default_factory=list)
    started: float = 0.0  # monotonic

    def recovery_s(self, k: int) -> float | None:
        """Seconds from fault k firing to its victim's next token: how long the fault held the
        request up. None if it did not fire or the victim got no token after it."""
        if k not in self.fired:
            return None
        out = self.outcomes[self.scenario.faults[k].victim]
        later = [t for t in out.token_times if t >= self.fired[k]]
        return later[0] - self.fired[k] if later else None


class FaultCluster:
    """Prefill and decode workers of the tiny model in this process behind two routers, each with
    its own gRPC server, with the fault seams above. `run(scenario)` runs one scenario and `heal()`
    puts the cluster back in shape for the next."""

    def __init__(
        self,
        model_dir: Path,
        num_prefill: int = 2,
        num_decode: int = 2,
        transfer_timeout_s: float = 0.25,
        control_timeout_s: float = 10.0,
    ) -> None:
        self.model_dir = model_dir
        self.cfg = ServeConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            num_prefill=num_prefill,
            num_decode=num_decode,
            engine=EngineArgs(num_kv_blocks=64),
            cpu_threads_per_worker=1,
            lease_s=NORMAL_LEASE_S,
            transfer_timeout_s=transfer_timeout_s,
            router_lease_s=ROUTER_LEASE_S,
        )
        self.lt = LoopThread()
        self.dead: set[str] = set()
        self._killed: dict[str, asyncio.Event] = {}
        # (method, request id) -> (when: "before" | "during" | "after" the call, the fault's index)
        self.armed_kills: dict[tuple[str, str], tuple[str, int]] = {}
        # (method, request id, "before" | "after" the call) -> the router_dies fault's index
        self.armed_router_kills: dict[tuple[str, str, str], int] = {}
        self.poll_delay_s: dict[str, float] = {}  # worker id -> seconds before each token poll reaches it
        self.late_polls: dict[str, float] = {}  # worker id -> its next poll's answer comes this late, once
        self.fired: dict[int, float] = {}
        self._next_id = {"prefill": num_prefill, "decode": num_decode}
        self._runs = 0
        self._retired: list[Any] = []  # killed workers, their NIXL agents closed one heal later
        self.workers: dict[str, Any] = {}
        self.offline = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=1024)
        self._references: dict[tuple, Reference] = {}
        prefills = [self._build("prefill", f"prefill-{i}") for i in range(num_prefill)]
        decodes = [self._build("decode", f"decode-{i}") for i in range(num_decode)]
        for p in prefills:
            for d in decodes:
                self._link(p, d)
        mc = ModelConfig.from_dir(model_dir)
        self.vocab_size = mc.vocab_size
        self.tokenizer = load_tokenizer(model_dir)
        self.router_config = RouterConfig(
            model_id=model_dir.name,
            max_model_len=mc.max_model_len,
            vocab_size=mc.vocab_size,
            # Control calls (token polls among them) get a long deadline: on a loaded 2-core host the
            # router's loop can stall for seconds, and a poll answered past its deadline loses
            # tokens (test_a_token_poll_answered_late_loses_no_token).
            prefill_timeout_s=5.0,
            decode_start_timeout_s=5.0,
            token_timeout_s=0.5,  # a slow worker's silence (slow_decode) passes it: the busy-not-dead path
            control_timeout_s=control_timeout_s,
            poll_wait_s=0.02,
            membership=MembershipConfig(wait_s=0.05, min_interval_s=0.0, timeout_s=2.0, max_failures=2, retry_s=0.02),
        )
        self.routers = [self._start_router(slot) for slot in range(ROUTERS)]

    @property
    def router(self) -> Router:
        """The first router (tests that want one)."""
        router = self.routers[0].router
        assert router is not None
        return router

    @property
    def admin(self) -> pbg.AdminStub:
        admin = self.routers[0].admin
        assert admin is not None
        return admin

    # ----- routers ---------------------------------------------------------------------------

    def _start_router(self, slot: int) -> RouterReplica:
        """A router over the live workers, as `pdserve router` joins them: a new id, its own
        clients of each worker, its own gRPC server."""
        replica = RouterReplica(slot, new_router_id())
        live = [w for wid, w in self.workers.items() if wid not in self.dead]
        prefills = [self._client(w, replica) for w in live if w.worker_id.startswith("prefill")]
        decodes = [self._client(w, replica) for w in live if w.worker_id.startswith("decode")]
        router = MortalRouter(self.router_config, self.tokenizer, prefills, decodes)

        async def start() -> Any:
            await router.start()
            server, port = await start_grpc_server(router, "127.0.0.1", 0)
            link = SeverableLink(port)
            await link.start()
            return server, link

        replica.router = router
        replica.server, replica.link = self.lt.run(start())
        replica.channel = grpc.insecure_channel(f"127.0.0.1:{replica.link.port}")
        replica.stub = pbg.InferenceStub(replica.channel)
        replica.admin = pbg.AdminStub(replica.channel)
        return replica

    def kill_router(self, replica: RouterReplica, fault: int) -> bool:
        """On the loop's thread: the router dies, as under SIGKILL. None of its calls reaches a
        worker from now on (its invokers refuse them at once), its gRPC server stops (every call
        on it ends UNAVAILABLE, later ones cannot connect: its clients' connections are reset as
        a dead process's are, then its server stops behind them) and its relay and membership
        tasks stop. Nothing is aborted or released for it: its requests are the workers' to reap.
        False if it was dead already."""
        if replica.dead:
            return False
        router, server = replica.router, replica.server
        assert router is not None
        replica.dead = router.dead = True
        self.fired.setdefault(fault, time.monotonic())
        assert replica.link is not None
        replica.link.sever()

        async def stop() -> None:
            await server.stop(None)
            await router.stop()

        replica.stopped = asyncio.run_coroutine_threadsafe(stop(), self.lt.loop)
        return True

    def _kill_router_of(self, i: int, k: int) -> None:
        if k not in self.fired:
            self.kill_router(self.routers[router_of(i)], k)

    async def _every_router_death(self, scenario: Scenario) -> None:
        for k, f in enumerate(scenario.faults):
            if f.kind == ROUTER_DIES:
                self._kill_router_of(f.victim, k)

    # ----- workers ---------------------------------------------------------------------------

    def _build(self, role: str, worker_id: str) -> Any:
        if role == "prefill":
            w = build_prefill(worker_id, self.cfg)
        else:
            w = build_decode(worker_id, self.cfg, wrap_transport=lambda t: FaultyTransport(t))
        self.workers[worker_id] = w
        return w

    @staticmethod
    def _link(p: Any, d: Any) -> None:
        d.agent.connect(p.agent.info())
        p.agent.connect(d.agent.info())

    def _client(self, worker: Any, replica: RouterReplica) -> Tap:
        client = WorkerClient(worker.worker_id, _Severable(self, worker, replica), router_id=replica.router_id)
        return Tap(client, self, replica)

    def kill(self, worker_id: str, fault: int | None = None) -> None:
        """On the loop's thread: the worker dies. Its engine stops; calls to it fail; READs of
        its KV fail."""
        if worker_id in self.dead:
            return
        self.dead.add(worker_id)
        if fault is not None:
            self.fired.setdefault(fault, time.monotonic())
        self._killed.setdefault(worker_id, asyncio.Event()).set()
        w = self.workers[worker_id]
        # Its engine stops on a thread: joining it here would stall the router's loop.
        threading.Thread(target=w.close, name=f"kill-{worker_id}", daemon=True).start()
        if worker_id.startswith("prefill"):
            for d in self._live("decode"):
                d.agent.dead_agents.add(w.agent.name)

    def _live(self, role: str) -> list[Any]:
        return [w for wid, w in self.workers.items() if wid.startswith(role) and wid not in self.dead]

    def heal(self) -> None:
        """Undo the scenario's faults: links healthy, leases and polls normal, each killed
        worker replaced by a new one (new id, cold cache) that joins each router through the
        add-worker path, and a killed router by a new one (new id) over the workers."""
        for d in self._live("decode"):
            d.agent.arm()
            d.agent.arm_corruption(0)
            d.agent.dead_agents.clear()
        for p in self._live("prefill"):
            p.config = replace(p.config, lease_s=NORMAL_LEASE_S)
        self.poll_delay_s.clear()
        self.late_polls.clear()
        self.armed_kills.clear()
        self.armed_router_kills.clear()
        for old in self._retired:  # killed a scenario ago: nothing of theirs is in flight now
            old.agent.close()
        self._retired = []
        live = [r for r in self.routers if not r.dead]
        for wid in sorted(self.dead):
            for r in live:
                assert r.router is not None
                self.lt.run(r.router.drain(wid, 0.0))
            self._retired.append(self.workers.pop(wid))
            role = wid.split("-")[0]
            new_id = f"{role}-{self._next_id[role]}"
            self._next_id[role] += 1
            w = self._build(role, new_id)
            for peer in self._live("decode" if role == "prefill" else "prefill"):
                self._link(*((w, peer) if role == "prefill" else (peer, w)))
            for r in live:
                assert r.router is not None
                add = r.router.add_prefill if role == "prefill" else r.router.add_decode
                self.lt.run(add(self._client(w, r)))
        self.dead.clear()
        self._killed.clear()
        for slot, r in enumerate(self.routers):
            if r.dead:
                assert r.stopped is not None and r.channel is not None
                r.stopped.result(30)
                r.channel.close()
                self.routers[slot] = self._start_router(slot)

    def close(self) -> None:
        for r in self.routers:
            assert r.router is not None and r.channel is not None
            r.channel.close()
            if r.dead:
                if r.stopped is not None:
                    r.stopped.result(30)
                continue
            self.lt.run(_stop_router(r.server, r.router))
            assert r.link is not None
            self.lt.call(r.link.sever)
        for w in [*self.workers.values(), *self._retired]:
            w.close()
            w.agent.close()
        self.workers.clear()
        self.lt.close()

    # ----- one scenario ---------------------------------------------------------------------

    def references(self, scenario: Scenario) -> list[Reference]:
        """Each request's fault-free tokens and text, from the offline engine (cached)."""
        keys = [_key(r) for r in scenario.requests]
        missing = [(k, r) for k, r in zip(keys, scenario.requests) if k not in self._references]
        if missing:
            outs = self.offline.generate([list(r.prompt) for _, r in missing], [_params(r) for _, r in missing])
            for (k, _), o in zip(missing, outs):
                self._references[k] = Reference(tuple(o.token_ids), o.text, o.finish_reason or "")
        return [self._references[k] for k in keys]

    def run(self, scenario: Scenario) -> ScenarioResult:
        refs = self.references(scenario)
        self._runs += 1
        self.fired = {}
        self._arm(scenario)
        t0 = time.monotonic()
        outcomes = [Outcome() for _ in scenario.requests]
        threads = [
            threading.Thread(target=self._client_call, args=(scenario, i, outcomes[i], t0), daemon=True)
            for i in range(len(scenario.requests))
        ]
        timers = [
            threading.Timer(f.delay_s, self.lt.call, args=(lambda i=f.victim, k=k: self._kill_router_of(i, k),))
            for k, f in enumerate(scenario.faults)
            if f.kind == ROUTER_DIES and f.point == "timer"
        ]
        for t in [*threads, *timers]:
            t.start()
        for t in threads:
            t.join(max(r.deadline_s for r in scenario.requests) + 10)
        for timer in timers:
            timer.cancel()
            timer.join()  # one firing now has queued its death on the loop by the time it ends
        # Every drawn death has happened before the checks: one queued on the loop by a client's
        # thread or a timer may not have run yet, and heal() would then keep that router, which
        # dies under the idle check or the next scenario. Queued calls run first, in order.
        self.lt.run(self._every_router_death(scenario))
        for i, out in enumerate(outcomes):
            r = self.routers[router_of(i)]
            assert r.router is not None
            out.ended_before_its_router_died = r.dead and self.request_id(scenario, i) in r.router.ended_alive
        result = ScenarioResult(scenario, outcomes, refs, dict(self.fired), started=t0)
        result.violations = check_scenario(scenario, outcomes, refs)
        if any(t.is_alive() for t in threads):
            result.violations.append("a client call did not return within its deadline plus 10 s")
        self.heal()
        result.violations += self._check_idle(scenario)
        return result

    def request_id(self, scenario: Scenario, i: int) -> str:
        """Unique per run: the same seed may run twice on one cluster."""
        return f"s{scenario.seed}-{self._runs}-r{i}"

    def _arm(self, scenario: Scenario) -> None:
        for k, f in enumerate(scenario.faults):
            rid = self.request_id(scenario, f.victim)
            if f.kind in KILLS:
                method = "prefill" if KILLS[f.kind] == "prefill" else "start"
                when = (
                    f.kind.split("_")[-1]
                    if KILLS[f.kind] == "prefill"
                    else {"decode_dies_before_pull": "before", "decode_dies_during_start": "during"}.get(f.kind)
                )
                if when is not None:
                    self.armed_kills[(method, rid)] = (when, k)
            elif f.kind == "transfer_fails":
                for d in self._live("decode"):
                    d.agent.arm(fail_reads=f.count)
                self.fired[k] = time.monotonic()
            elif f.kind == "transfer_dropped":
                for d in self._live("decode"):
                    d.agent.arm(drop_reads=f.count)
                for p in self._live("prefill"):
                    p.config = replace(p.config, lease_s=f.lease_s)
                self.fired[k] = time.monotonic()
            elif f.kind == ROUTER_DIES:
                # What a dead router had prefilled is held until the prefill lease ends.
                for p in self._live("prefill"):
                    p.config = replace(p.config, lease_s=min(p.config.lease_s, f.lease_s))
                calls = {
                    "before_prefill": [("prefill", "before"), ("submit", "before")],
                    "after_prefill": [("prefill", "after"), ("submit", "after")],
                    "after_start": [("start", "after"), ("submit", "after")],
                }.get(f.point, [])  # mid_stream and timer fire from the client and a timer
                for method, when in calls:
                    self.armed_router_kills[(method, rid, when)] = k
            elif f.kind == "transfer_corrupted":
                for d in self._live("decode"):
                    d.agent.arm_corruption(f.count, f.corruption)
                self.fired[k] = time.monotonic()
            elif f.kind == "slow_decode":
                slow = self._live("decode")[f.victim % len(self._live("decode"))]
                slow.agent.arm(delay_s=f.delay_s)
                self.poll_delay_s[slow.worker_id] = f.delay_s
                self.fired[k] = time.monotonic()

    def _client_call(self, scenario: Scenario, i: int, out: Outcome, t0: float) -> None:
        spec = scenario.requests[i]
        rid = self.request_id(scenario, i)
        mid = [(k, f) for k, f in enumerate(scenario.faults) if f.victim == i and f.at]
        delay = t0 + spec.start_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        request = pb.GenerateRequest(
            prompt_token_ids=list(spec.prompt),
            request_id=rid,
            sampling_params=pb.SamplingParams(
                max_tokens=spec.max_tokens,
                temperature=spec.temperature,
                ignore_eos=spec.ignore_eos,
                **({"seed": spec.seed} if spec.seed is not None else {}),
            ),
        )
        start = time.monotonic()
        stub = self.routers[router_of(i)].stub
        assert stub is not None
        call = stub.Generate(request, timeout=spec.deadline_s)
        try:
            for chunk in call:
                out.token_times.append(time.monotonic())
                out.token_ids += chunk.token_ids
                out.text += chunk.text
                out.chunk_sizes.append(len(chunk.token_ids))
                if chunk.finish_reason:
                    out.finish_reason = chunk.finish_reason
                    out.completion_tokens = chunk.usage.completion_tokens
                for k, f in mid:
                    if len(out.token_ids) >= f.at and k not in self.fired:
                        if f.kind == "client_cancels" and not out.finish_reason:
                            self.fired[k] = time.monotonic()
                            out.cancelled_by_client = True
                            call.cancel()
                        elif f.kind == "decode_dies_mid_stream":
                            self.lt.call(lambda k=k: self._kill_stream_worker(rid, k))
                        elif f.kind == "late_poll":
                            self.lt.call(lambda k=k, f=f: self._slow_answer(rid, k, f.delay_s))
                        elif f.kind == ROUTER_DIES:
                            self.lt.call(lambda k=k: self._kill_router_of(i, k))
        except grpc.RpcError as exc:
            out.code = exc.code().name
            out.details = exc.details() or ""
        out.ended_at = time.monotonic()
        out.wall_s = out.ended_at - start
        # The victim's router dies at the latest when its call ends (its point never came: it
        # finished early, or was prefilled where no armed call went), so every drawn death happens.
        for k, f in enumerate(scenario.faults):
            if f.kind == ROUTER_DIES and f.victim == i:
                self.lt.call(lambda k=k: self._kill_router_of(i, k))

    def _stream(self, rid: str) -> Any:
        """The request's stream on whichever live router serves it."""
        for r in self.routers:
            if r.router is not None and not r.dead and rid in r.router._streams:
                return r.router._streams[rid]
        return None

    def _kill_stream_worker(self, rid: str, k: int) -> None:
        stream = self._stream(rid)
        if stream is not None and stream.worker is not None and k not in self.fired:
            self.kill(stream.worker, k)

    def _slow_answer(self, rid: str, k: int, delay_s: float) -> None:
        stream = self._stream(rid)
        if stream is not None and stream.worker is not None and k not in self.fired:
            self.fired[k] = time.monotonic()
            self.late_polls[stream.worker] = delay_s

    def _check_idle(self, scenario: Scenario) -> list[str]:
        """Once idle, every worker answers and holds no KV block, and no router has one out of
        placement. A lease the scenario shortened, and a dead router's lease on the decode
        workers, may hold blocks that long."""
        routers_died = any(f.kind == ROUTER_DIES for f in scenario.faults)
        short_lease = max([f.lease_s for f in scenario.faults] + [ROUTER_LEASE_S] * routers_died, default=0.0)
        deadline = time.monotonic() + BLOCKS_FREE_S + short_lease
        while True:
            stats = self.admin.GetStats(pb.GetStatsRequest(), timeout=10)
            held = {
                w.worker_id: (w.role, w.kv_blocks_in_use)
                for w in stats.workers
                if w.role not in ("prefill", "decode") or w.kv_blocks_in_use
            }
            down = set(stats.down_workers)
            for r in self.routers[1:]:
                assert r.admin is not None
                down |= set(r.admin.GetStats(pb.GetStatsRequest(), timeout=10).down_workers)
            if not held and not down:
                return []
            if time.monotonic() > deadline:
                return [
                    (
                        f"idle after the scenario, {BLOCKS_FREE_S + short_lease:.1f}s on: KV blocks in use or "
                        f"workers not answering {held}; out of placement {sorted(down)}"
                    )
                ]
            time.sleep(0.02)


async def _stop_router(server: Any, router: Router) -> None:
    await server.stop(1)
    await router.drain_cleanups()
    await router.stop()


def _params(spec: RequestSpec) -> SamplingParams:
    return SamplingParams(
        max_tokens=spec.max_tokens, temperature=spec.temperature, seed=spec.seed, ignore_eos=spec.ignore_eos
    )


def _key(spec: RequestSpec) -> tuple:
    return spec.prompt, spec.max_tokens, spec.temperature, spec.seed, spec.ignore_eos


def describe(result: ScenarioResult) -> str:
    """The scenario and what each client saw, for a failure message."""
    s = result.scenario
    fired = {k: round(max(0.0, t - result.started), 3) for k, t in sorted(result.fired.items())}
    lines = [f"faults: {[f for f in s.faults]} (fired, s into the scenario: {fired})"]
    for i, (spec, out) in enumerate(zip(s.requests, result.outcomes)):
        died = ", its router ended it before dying" if out.ended_before_its_router_died else ""
        lines.append(
            f"  request {i}: {len(spec.prompt)} prompt tokens, max_tokens={spec.max_tokens}, "
            f"T={spec.temperature}, deadline {spec.deadline_s}s, router {router_of(i)} -> {out.code} "
            f"{out.details!r}, {len(out.token_ids)} tokens in {out.wall_s:.2f}s, "
            f"ended {out.ended_at - result.started:.3f}s into the scenario{died}"
        )
    return "\n".join(lines)
