"""Which Ray nodes may host which pool. A node joins a pool by offering Ray the custom resource
`pdserve_prefill` or `pdserve_decode` (both for a node of either pool): the Helm chart's worker
groups and `deploy/ray/launch.sh --pool` do the same. A cluster where no node offers either is
unlabelled and every pool may run anywhere, as on a local cluster.

Custom resources rather than Ray node labels: the chart's KubeRay worker groups already carry
them, `ray.cluster_resources()` shows them to any driver, and a node of either pool is simply a
node offering both. The policy here is pure; `cluster_nodes` is the only call into Ray."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POOLS = ("prefill", "decode")

# What one worker asks of its pool's resource: the resource says where a pool may run, while GPUs
# (or a CPU node's memory) say how many workers fit, so a node offering 1 takes up to 1000.
POOL_SHARE = 0.001


def pool_resource(pool: str) -> str:
    if pool not in POOLS:
        raise ValueError(f"pool: {pool!r} is neither prefill nor decode")
    return f"pdserve_{pool}"


@dataclass(frozen=True)
class NodeOffer:
    """One alive Ray node as the placement check sees it."""

    address: str
    gpus: float
    pools: frozenset[str]  # the pools whose resource it offers


class PlacementError(RuntimeError):
    """The cluster cannot host a pool's workers; the message names the pool and what is missing."""


def nodes_from_ray(ray_nodes: Iterable[Mapping[str, Any]]) -> list[NodeOffer]:
    """`ray.nodes()` entries to offers; dead nodes host nothing."""
    offers = []
    for n in ray_nodes:
        if not n.get("Alive", False):
            continue
        res = n.get("Resources", {})
        pools = frozenset(p for p in POOLS if res.get(pool_resource(p), 0) > 0)
        offers.append(NodeOffer(str(n.get("NodeManagerAddress", "?")), float(res.get("GPU", 0)), pools))
    return offers


def labelled(nodes: Sequence[NodeOffer]) -> bool:
    return any(n.pools for n in nodes)


def actor_resources(pool: str, nodes: Sequence[NodeOffer]) -> dict[str, float]:
    """The custom resources a worker of `pool` asks for: its pool's, once any node offers one."""
    return {pool_resource(pool): POOL_SHARE} if labelled(nodes) else {}


def width_flag(pool: str) -> str:
    """The `pdserve serve` flag that sets a pool's tensor-parallel width."""
    return f"--{pool}-tensor-parallel-size"


def worker_gpus(device: str, width: int) -> int:
    """GPUs Ray reserves for one worker: one per rank on CUDA, all on one node (a worker's ranks
    share its host's memory); none on CPU, where the ranks are processes on the worker's cores."""
    if width < 1:
        raise ValueError(f"width: a worker spans at least one rank, not {width}")
    return width if device.startswith("cuda") else 0


def unplaceable(
    nodes: Sequence[NodeOffer], workers: Mapping[str, int], gpus_per_worker: float,
    widths: Mapping[str, int] | None = None,
) -> str | None:
    """One line naming the first pool the cluster cannot host and what it lacks; None if all fit.
    A worker of a pool whose width (`widths`, default 1) is N takes N x `gpus_per_worker` GPUs of
    one node. Counts the nodes' GPUs, not the free ones: workers that merely wait for a GPU in use
    are left to the start-up deadline. Refuses only what cannot fit (too few GPUs in a pool or in
    all, or too few nodes holding a whole worker), never a packing it did not find."""
    lab = labelled(nodes)
    need: dict[str, float] = {}
    for pool, count in workers.items():
        if count == 0:
            continue
        hosts = [n for n in nodes if pool in n.pools] if lab else list(nodes)
        if not hosts:
            others = ", ".join(f"{n.address} ({'+'.join(sorted(n.pools)) or 'no pool'})" for n in nodes)
            return (
                f"no Ray node offers the {pool} pool (resource {pool_resource(pool)}): "
                f"start one with `deploy/ray/launch.sh worker --pool {pool}`; nodes: {others or 'none'}"
            )
        width = (widths or {}).get(pool, 1)
        each = gpus_per_worker * width
        need[pool] = count * each
        if not each:
            continue
        have = sum(n.gpus for n in hosts)
        where = f"the nodes offering the {pool} pool have" if lab else "the cluster has"
        if width == 1:
            if have < need[pool]:
                return f"{count} {pool} workers need {need[pool]:g} GPUs; {where} {have:g}"
            continue
        # A worker's ranks share one node: count the whole workers each node holds.
        fits = sum(int(n.gpus // each) for n in hosts)
        if fits < count:
            per_node = ", ".join(f"{n.gpus:g}" for n in hosts)
            return (
                f"{count} {pool} workers of {width} ranks ({width_flag(pool)} {width}) need {each:g} GPUs "
                f"on one node each, {need[pool]:g} in all; {where} room for {fits} (GPUs per node: {per_node})"
            )
    if gpus_per_worker:
        # Nodes of both pools share their GPUs between the two.
        hosts = [n for n in nodes if n.pools] if lab else list(nodes)
        total = sum(need.values())
        have = sum(n.gpus for n in hosts)
        if have < total:
            return f"{sum(workers.values())} workers need {total:g} GPUs; the pools' nodes have {have:g} in all"
    return None


def cluster_device(device: str, nodes: Sequence[NodeOffer]) -> str:
    """The workers' device on a Ray cluster the router joined, read from the cluster's nodes and
    not from this process: the router runs no model, so its pod needs no GPU. auto is cuda once any
    node offers a GPU; cuda on a cluster without one is left to `unplaceable` to refuse."""
    if device == "auto":
        return "cuda" if any(n.gpus > 0 for n in nodes) else "cpu"
    if device == "cpu" or device.startswith("cuda"):
        return device
    raise ValueError(f"device: must be auto, cpu or cuda[:N], not {device!r}")


def cluster_nodes() -> list[NodeOffer]:
    """The connected Ray cluster's alive nodes."""
    import ray

    return nodes_from_ray(ray.nodes())
