"""`python -m pdserve.cluster.status --address HEAD:PORT`: the Ray cluster's nodes, the pools each
offers, and where each pdserve worker runs (what `deploy/ray/launch.sh status` prints). Both come
from Ray's state API, which the head's dashboard serves: run it on the head."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.cluster.node_pools import POOLS, pool_resource

NAMESPACE = "pdserve"  # as pdserve.cluster.serve names it; not imported: that module loads the router


def format_status(nodes: Sequence[Mapping[str, Any]], actors: Sequence[Mapping[str, Any]]) -> str:
    """Nodes and actors as the state API's `list_nodes` / `list_actors` give them."""
    lines = ["nodes:"]
    where: dict[str, str] = {}
    for n in sorted(nodes, key=lambda n: (not n.get("is_head_node"), n.get("node_ip", ""), n.get("node_id", ""))):
        res = n.get("resources_total") or {}
        pools = "+".join(p for p in POOLS if res.get(pool_resource(p), 0) > 0) or "no pool"
        address = n.get("node_ip", "?")
        where[n.get("node_id", "")] = address
        kind = "head" if n.get("is_head_node") else "node"
        lines.append(
            f"  {kind} {address:<15} {str(n.get('state', '?')).lower():<5} pool {pools:<14} "
            f"CPU {res.get('CPU', 0):g}  GPU {res.get('GPU', 0):g}  id {str(n.get('node_id', '?'))[:12]}"
        )
    workers = sorted((a for a in actors if a.get("ray_namespace") == NAMESPACE), key=lambda a: a.get("name") or "")
    lines.append("workers:" if workers else "workers: none (is `deploy/ray/launch.sh serve` running?)")
    for a in workers:
        node = where.get(a.get("node_id") or "", "not placed")
        lines.append(f"  {a.get('name') or a.get('actor_id', '?'):<20} {a.get('state', '?'):<16} on {node}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-cluster-status", description=__doc__)
    parser.add_argument("--address", required=True, metavar="HEAD:PORT", help="the Ray head's GCS address")
    args = parser.parse_args(argv)
    from ray.util.state import list_actors, list_nodes

    def rows(items: Sequence[Any]) -> list[dict[str, Any]]:
        return [i if isinstance(i, dict) else vars(i) for i in items]

    # Only live actors: Ray keeps the dead ones of earlier runs, under the same names.
    alive = [("state", "!=", "DEAD")]
    try:
        nodes = rows(list_nodes(address=args.address, limit=10000, raise_on_missing_output=False))
        actors = rows(list_actors(address=args.address, filters=alive, limit=10000, raise_on_missing_output=False))
    except Exception as exc:  # noqa: BLE001 - one line, not Ray's traceback
        print(f"status: Ray's state API at {args.address} did not answer ({type(exc).__name__}); it is served "
              "by the head's dashboard on loopback, so run status on the head", file=sys.stderr)
        return 1
    print(format_status(nodes, actors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
