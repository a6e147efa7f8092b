"""``phalanx``: the operator's command line.

The fleet commands talk to the supervisor's REST API at ``$PHALANX_API`` with
the token ``$PHALANX_TOKEN`` (or ``--api`` / ``--token``); ``eval "$(phalanx
local env)"`` sets both for a local fleet. Tables go to stdout by default,
stable JSON with ``-o json``; messages go to stderr.

Exit codes:
  0  success
  1  the supervisor failed or could not be reached
  2  bad usage (arguments, missing API settings)
  3  not found (an unknown node, no local fleet)
  4  refused (e.g. undraining a node that still reports drain reasons)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx import local
from phalanx.client import ApiError, Client

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _client(args: argparse.Namespace) -> Client:
    api = args.api or os.environ.get("PHALANX_API")
    token = args.token or os.environ.get("PHALANX_TOKEN")
    if not api or not token:
        raise CliError('no supervisor configured: set PHALANX_API and PHALANX_TOKEN (for a local '
                       'fleet: eval "$(phalanx local env)"), or pass --api and --token', EXIT_USAGE)
    return Client(api, token)


def _call(fn: Any, *a: Any) -> Any:
    try:
        return fn(*a)
    except ApiError as exc:
        code = {404: EXIT_NOT_FOUND, 409: EXIT_REFUSED, 400: EXIT_USAGE}.get(exc.status,
                                                                            EXIT_FAILED)
        raise CliError(str(exc), code) from None


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=False)).rstrip()
             for r in [headers, *rows]]
    return "\n".join(lines)


def _emit(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(table)


def _reasons(node: dict[str, Any]) -> str:
    codes = [r["code"] + (f"(gpu{r['gpu']})" if r.get("gpu") is not None else "")
             for r in node["reasons"]]
    drain = node.get("drain")
    if drain and drain["by"] == "operator":
        codes.append(f"operator: {drain['reason']}")
    return ", ".join(codes) or "-"


def cmd_nodes(args: argparse.Namespace) -> int:
    nodes = _call(_client(args).get, "/v1/nodes")
    rows = [[n["id"], n["state"], n["rack"] or "-", str(n["gpu_count"]), _reasons(n)]
            for n in nodes]
    _emit(args, nodes, _table(rows, ["NODE", "STATE", "RACK", "GPUS", "REASONS"]))
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    node = _call(_client(args).post, f"/v1/nodes/{args.node}/drain", {"reason": args.reason})
    print(f"node {node['id']} drained: {args.reason}", file=sys.stderr)
    _emit(args, node, f"{node['id']}  {node['state']}")
    return EXIT_OK


def cmd_undrain(args: argparse.Namespace) -> int:
    node = _call(_client(args).post, f"/v1/nodes/{args.node}/undrain", {"force": args.force})
    print(f"node {node['id']} undrained", file=sys.stderr)
    _emit(args, node, f"{node['id']}  {node['state']}")
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    query = f"?limit={args.limit}" + (f"&node={args.node}" if args.node else "")
    events = _call(_client(args).get, f"/v1/events{query}")
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"])), e["node"] or "-",
             e["kind"], _detail(e["detail"])] for e in events]
    _emit(args, events, _table(rows, ["TIME", "NODE", "EVENT", "DETAIL"]))
    return EXIT_OK


def _detail(detail: dict[str, Any]) -> str:
    parts = []
    for key, value in detail.items():
        if key == "reasons":
            value = ",".join(r["code"] for r in value) or "-"
        parts.append(f"{key}={value}")
    return " ".join(parts)


# --- local fleet ----------------------------------------------------------


def cmd_local_up(args: argparse.Namespace) -> int:
    print(f"starting a local fleet of {args.nodes} nodes x {args.gpus_per_node} sim GPUs in "
          f"{args.dir} ...", file=sys.stderr)
    fleet = local.up(Path(args.dir), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                     nodes_per_rack=args.nodes_per_rack, timeout=args.timeout,
                     broker=args.broker)
    print(f"local fleet up: API {fleet.api}; point the CLI at it with:\n"
          f'  eval "$(phalanx local env --dir {args.dir})"', file=sys.stderr)
    return EXIT_OK


def cmd_local_env(args: argparse.Namespace) -> int:
    fleet = local.Fleet.load(Path(args.dir).absolute())
    print(f"export PHALANX_API={fleet.api}")
    print(f"export PHALANX_TOKEN={fleet.token}")
    print(f"export PHALANX_LOCAL_DIR={fleet.dir}")
    return EXIT_OK


def cmd_local_inject(args: argparse.Namespace) -> int:
    fleet = local.Fleet.load(Path(args.dir).absolute())
    from agentd.gpu.sim import inject

    try:
        inject(fleet.sim_file(args.node), args.gpu, args.fault)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(f"injected {args.fault} into {args.node} GPU {args.gpu}", file=sys.stderr)
    return EXIT_OK


def cmd_local_status(args: argparse.Namespace) -> int:
    fleet = local.Fleet.load(Path(args.dir).absolute())
    procs = [{"role": p.role, "node": p.node, "pid": p.pid, "alive": p.alive(), "log": p.log}
             for p in fleet.processes]
    rows = [[str(p["role"]), str(p["node"] or "-"), str(p["pid"]), "yes" if p["alive"] else "no"]
            for p in procs]
    _emit(args, procs, _table(rows, ["ROLE", "NODE", "PID", "ALIVE"]))
    return EXIT_OK


def cmd_local_down(args: argparse.Namespace) -> int:
    procs = local.down(Path(args.dir))
    print(f"stopped {len(procs)} processes", file=sys.stderr)
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx", description="Operate a Phalanx fleet.",
        epilog="exit codes: 0 ok, 1 supervisor failed or unreachable, 2 bad usage, "
        "3 not found, 4 refused",
    )
    p.add_argument("--api", help="supervisor URL (default: $PHALANX_API)")
    p.add_argument("--token", help="API token (default: $PHALANX_TOKEN)")
    sub = p.add_subparsers(dest="command", required=True)

    def out(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-o", "--output", choices=["table", "json"], default="table")

    sp = sub.add_parser("nodes", help="list nodes, their state and reasons")
    out(sp)
    sp.set_defaults(fn=cmd_nodes)
    sp = sub.add_parser("drain", help="take a node out of placement")
    sp.add_argument("node")
    sp.add_argument("--reason", required=True)
    out(sp)
    sp.set_defaults(fn=cmd_drain)
    sp = sub.add_parser("undrain", help="return a drained node to placement")
    sp.add_argument("node")
    sp.add_argument("--force", action="store_true",
                    help="undrain even while the node still reports drain reasons")
    out(sp)
    sp.set_defaults(fn=cmd_undrain)
    sp = sub.add_parser("events", help="the fleet's event log, oldest first")
    sp.add_argument("--node")
    sp.add_argument("--limit", type=int, default=50)
    out(sp)
    sp.set_defaults(fn=cmd_events)

    lp = sub.add_parser("local", help="a whole fleet on this machine (sim GPUs)")
    lsub = lp.add_subparsers(dest="local_command", required=True)

    def ldir(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--dir", default=str(local.DEFAULT_DIR),
                        help="fleet directory (default: $PHALANX_LOCAL_DIR or ./.phalanx-local)")

    sp = lsub.add_parser("up", help="start broker, supervisor and agents")
    sp.add_argument("--nodes", type=int, default=3)
    sp.add_argument("--gpus-per-node", type=int, default=4)
    sp.add_argument("--nodes-per-rack", type=int, default=2)
    sp.add_argument("--timeout", type=float, default=60.0)
    sp.add_argument("--broker", choices=["auto", "mosquitto", "embedded"], default="auto",
                    help="auto: Mosquitto where installed, else the embedded amqtt broker")
    ldir(sp)
    sp.set_defaults(fn=cmd_local_up)
    sp = lsub.add_parser("env", help="print the exports that point the CLI at the fleet")
    ldir(sp)
    sp.set_defaults(fn=cmd_local_env)
    sp = lsub.add_parser("inject", help="inject a fault into a node's simulated GPU")
    sp.add_argument("--node", required=True)
    sp.add_argument("--gpu", type=int, required=True)
    from agentd.gpu.sim import FAULTS

    sp.add_argument("--fault", required=True, choices=FAULTS)
    ldir(sp)
    sp.set_defaults(fn=cmd_local_inject)
    sp = lsub.add_parser("status", help="the processes the fleet started")
    out(sp)
    ldir(sp)
    sp.set_defaults(fn=cmd_local_status)
    sp = lsub.add_parser("down", help="stop everything the fleet started")
    ldir(sp)
    sp.set_defaults(fn=cmd_local_down)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CliError as exc:
        print(f"phalanx: {exc}", file=sys.stderr)
        return exc.code
    except local.LocalFleetError as exc:
        print(f"phalanx: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND if "no local fleet" in str(exc) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
