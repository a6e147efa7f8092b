"""``phalanx local``: a whole fleet on this machine (broker, supervisor, sim agents)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from phalanx import local
from phalanx.cli.base import EXIT_OK, EXIT_USAGE, CliError, emit, table


def cmd_local_up(args: argparse.Namespace) -> int:
    nvml = args.gpu_backend == "nvml"
    nodes = args.nodes if args.nodes is not None else (1 if nvml else 3)
    if nvml:
        what = "1 node on this machine's real GPUs (NVML)"
    else:
        what = f"{nodes} nodes x {args.gpus_per_node} sim GPUs"
    if nvml and nodes != 1:
        raise CliError(
            f"--nodes {nodes} with --gpu-backend nvml: this machine's GPUs are one node", EXIT_USAGE
        )
    print(f"starting a local fleet of {what} in {args.dir} ...", file=sys.stderr)
    fleet = local.up(
        Path(args.dir),
        nodes=nodes,
        gpus_per_node=args.gpus_per_node,
        nodes_per_rack=args.nodes_per_rack,
        timeout=args.timeout,
        broker=args.broker,
        spares=args.spares,
        tls=args.tls,
        gpu_backend=args.gpu_backend,
        store_url=args.store_url,
        standbys=args.standbys,
    )
    first = fleet.api.split(",")[0]
    print(
        f"local fleet up: API {fleet.api}; point the CLI at it with:\n"
        f'  eval "$(phalanx local env --dir {args.dir})"\n'
        f"the web dashboard: {first}/ui/ (log in with the token in {args.dir}/token)",
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_local_env(args: argparse.Namespace) -> int:
    fleet = local.Fleet.load(Path(args.dir).absolute())
    print(f"export PHALANX_API={fleet.api}")
    print(f"export PHALANX_TOKEN={fleet.token}")
    # A fleet without TLS unsets a CA left over from another one.
    print(f"export PHALANX_CA={fleet.ca}" if fleet.ca else "unset PHALANX_CA")
    print(f"export PHALANX_LOCAL_DIR={fleet.dir}")
    return EXIT_OK


def cmd_local_inject(args: argparse.Namespace) -> int:
    fleet = local.Fleet.load(Path(args.dir).absolute())
    from phalanx.simgpu import inject

    try:
        inject(fleet.sim_file(args.node), args.gpu, args.fault)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(f"injected {args.fault} into {args.node} GPU {args.gpu}", file=sys.stderr)
    return EXIT_OK


def cmd_local_status(args: argparse.Namespace) -> int:
    fleet = local.Fleet.load(Path(args.dir).absolute())
    procs = [
        {"role": p.role, "node": p.node, "pid": p.pid, "alive": p.alive(), "log": p.log}
        for p in fleet.processes
    ]
    rows = [
        [str(p["role"]), str(p["node"] or "-"), str(p["pid"]), "yes" if p["alive"] else "no"]
        for p in procs
    ]
    emit(args, procs, table(rows, ["ROLE", "NODE", "PID", "ALIVE"]))
    return EXIT_OK


def cmd_local_down(args: argparse.Namespace) -> int:
    procs = local.down(Path(args.dir))
    print(f"stopped {len(procs)} processes", file=sys.stderr)
    return EXIT_OK


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    out: Callable[[argparse.ArgumentParser], None],
) -> None:
    """The ``local`` command and its subcommands, under ``sub``."""
    lp = sub.add_parser(
        "local", help="a whole fleet on this machine (sim GPUs, or its real GPUs as one node)"
    )
    lsub = lp.add_subparsers(dest="local_command", required=True)

    def ldir(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--dir",
            default=str(local.DEFAULT_DIR),
            help="fleet directory (default: $PHALANX_LOCAL_DIR or ./.phalanx-local)",
        )

    sp = lsub.add_parser("up", help="start broker, supervisor and agents")
    sp.add_argument(
        "--nodes", type=int, default=None, help="agents (default 3; 1 with --gpu-backend nvml)"
    )
    sp.add_argument(
        "--gpus-per-node", type=int, default=4, help="simulated GPUs per agent (sim only)"
    )
    sp.add_argument(
        "--gpu-backend",
        choices=list(local.GPU_BACKENDS),
        default="sim",
        help="sim: simulated GPUs (faults by `local inject`); nvml: one agent on this "
        "machine's real NVIDIA GPUs, NVML health, ranks on them (CUDA_VISIBLE_DEVICES)",
    )
    sp.add_argument("--nodes-per-rack", type=int, default=2)
    sp.add_argument(
        "--spares",
        type=int,
        default=0,
        help="idle nodes the supervisor holds back as hot spares for recovery",
    )
    sp.add_argument("--timeout", type=float, default=60.0)
    sp.add_argument(
        "--tls",
        action="store_true",
        help="HTTPS everywhere (API, agents' peer tier and logs) with a throw-away CA and "
        "certificates made under DIR/tls",
    )
    sp.add_argument(
        "--store-url",
        default="",
        help="the supervisors' store: a PostgreSQL database (postgresql://...; its password "
        "in PGPASSFILE or ~/.pgpass); default: SQLite in the fleet's folder",
    )
    sp.add_argument(
        "--standbys",
        type=int,
        default=0,
        help="more supervisors on --store-url, standing by to lead when the leader dies "
        "(`phalanx local env` lists every API URL)",
    )
    sp.add_argument(
        "--broker",
        choices=["auto", "mosquitto", "embedded"],
        default="auto",
        help="auto: Mosquitto where installed, else the embedded amqtt broker",
    )
    ldir(sp)
    sp.set_defaults(fn=cmd_local_up)
    sp = lsub.add_parser("env", help="print the exports that point the CLI at the fleet")
    ldir(sp)
    sp.set_defaults(fn=cmd_local_env)
    sp = lsub.add_parser("inject", help="inject a fault into a node's simulated GPU")
    sp.add_argument("--node", required=True)
    sp.add_argument("--gpu", type=int, required=True)
    from phalanx.simgpu import FAULTS

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
