"""What must hold after every fault scenario, as pure checks of what the clients saw against a
fault-free reference. Each returns a list of violations (empty: it held), worded to be read
next to the scenario that produced them."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.faults.scenarios import Scenario

# The statuses a request may end with under a fault: the cluster gave up cleanly.
CLEAN_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED"})
DEADLINE_SLACK_S = 1.0  # past the deadline, for the client's own thread to see the end
# What a client's gRPC library says when the connection under its call goes: reset or closed by
# a dead router's host, refused on reconnecting, or (an in-process server's stop) cancelled.
CONNECTION_LOST = (
    "Connection reset by peer",
    "Socket closed",
    "Stream removed",
    "failed to connect to all addresses",
    "Connection refused",
    "Broken pipe",
    "Cancelling all calls",
)


def connection_lost(details: str) -> bool:
    """The status is the transport's, not a word from the router."""
    return any(m in details for m in CONNECTION_LOST)


@dataclass(frozen=True)
class Reference:
    """A fault-free run of one request (the offline engine, greedy or seeded)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str


@dataclass
class Outcome:
    """What one client saw of its request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunk_sizes: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # monotonic time of each chunk
    finish_reason: str = ""
    completion_tokens: int = -1  # usage of the last chunk
    code: str = "OK"  # the gRPC status it ended with
    details: str = ""
    cancelled_by_client: bool = False
    wall_s: float = 0.0
    ended_at: float = 0.0  # monotonic, when the client saw the end
    # Set by the harness: its router died, but had ended the request (sent its last chunk or
    # its error) before that, so the status is the router's own.
    ended_before_its_router_died: bool = False


def check_outcome(scenario: Scenario, i: int, out: Outcome, ref: Reference) -> list[str]:
    spec = scenario.requests[i]
    where = f"request {i}"
    bad: list[str] = []
    if out.token_ids != list(ref.token_ids[: len(out.token_ids)]):
        bad.append(
            f"{where}: tokens {out.token_ids} are not a prefix of the fault-free {list(ref.token_ids)} "
            f"(a token lost, repeated or wrong)"
        )
    if not ref.text.startswith(out.text):
        bad.append(f"{where}: text {out.text!r} is not a prefix of the fault-free {ref.text!r}")
    if any(n == 0 for n in out.chunk_sizes[:-1]):
        bad.append(f"{where}: an empty chunk before the last: sizes {out.chunk_sizes}")
    if out.wall_s > spec.deadline_s + DEADLINE_SLACK_S:
        bad.append(f"{where}: ran {out.wall_s:.2f}s past its {spec.deadline_s}s deadline")
    if out.code == "OK":
        if out.token_ids != list(ref.token_ids):
            bad.append(
                f"{where}: finished with {len(out.token_ids)} tokens, the fault-free run has {len(ref.token_ids)}"
            )
        if out.text != ref.text:
            bad.append(f"{where}: text {out.text!r} != fault-free {ref.text!r}")
        if out.finish_reason != ref.finish_reason:
            bad.append(f"{where}: finish_reason {out.finish_reason!r} != fault-free {ref.finish_reason!r}")
        if out.completion_tokens != len(out.token_ids):
            bad.append(
                f"{where}: usage says {out.completion_tokens} completion tokens, the stream had {len(out.token_ids)}"
            )
        return bad
    if out.code not in CLEAN_CODES:
        bad.append(f"{where}: ended {out.code} ({out.details!r}), not one of {sorted(CLEAN_CODES)}")
    if not out.details.strip():
        bad.append(f"{where}: ended {out.code} without a message")
    # A request its router had ended before dying is judged as on a live router: the death
    # excuses nothing the router said. Only its status may not have reached the client before
    # the connection went (a handler's end is not its status on the wire), and the lost
    # connection's UNAVAILABLE reached the client instead.
    ended_first = scenario.on_dead_router(i) and out.ended_before_its_router_died
    if ended_first and out.code == "UNAVAILABLE" and connection_lost(out.details):
        return bad
    may_fail = scenario.may_fail(i, count_router_death=not ended_first)
    if scenario.on_dead_router(i) and not ended_first:  # its connection broke, unless it ran out of time first
        allowed = {
            "UNAVAILABLE",
            *(["DEADLINE_EXCEEDED"] if spec.tight else []),
            *(["CANCELLED"] if out.cancelled_by_client else []),
        }
        if out.code not in allowed:
            bad.append(f"{where}: its router died, yet it ended {out.code} ({out.details!r}), not UNAVAILABLE")
    if out.code == "CANCELLED" and not out.cancelled_by_client:
        bad.append(f"{where}: CANCELLED though the client did not cancel it ({out.details!r})")
    if out.cancelled_by_client and out.code != "CANCELLED":
        bad.append(f"{where}: the client cancelled it but it ended {out.code} ({out.details!r})")
    if out.code == "DEADLINE_EXCEEDED" and not spec.tight and out.wall_s < spec.deadline_s and not may_fail:
        bad.append(f"{where}: DEADLINE_EXCEEDED after {out.wall_s:.2f}s of its {spec.deadline_s}s ({out.details!r})")
    if not may_fail:
        died = ", before its router died" if ended_first else ""
        bad.append(
            f"{where}: failed {out.code} ({out.details!r}){died} though the cluster had a worker of each "
            f"pool left and the deadline was {spec.deadline_s}s"
        )
    return bad


def check_scenario(scenario: Scenario, outcomes: list[Outcome], refs: list[Reference]) -> list[str]:
    bad: list[str] = []
    for i, (out, ref) in enumerate(zip(outcomes, refs, strict=True)):
        bad += check_outcome(scenario, i, out, ref)
    return bad
