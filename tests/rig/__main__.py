"""``python -m tests.rig``: the fault-injection rig's one entry point (run as root).

python -m tests.rig up [--hosts 4]          build the fleet, print where it is, wait
python -m tests.rig down                    remove what any run left here (not a live run)
python -m tests.rig run --fault KIND [--seed S] [--trials N] [-o json]
python -m tests.rig soak --mtbf 120 --minutes 10 [--seed S]
python -m tests.rig list                    the fault kinds and what each expects

run and soak take --inventory FILE to strike real hosts over SSH (an Ansible inventory on
which ansible/site.yml installed the fleet; docs/rig.md) instead of namespaces here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.rig.base import Fleet
from tests.rig.driver import run_scenario, soak, summary, undisturbed
from tests.rig.faults import FAULTS
from tests.rig.fleet import RigFleet, down_all
from tests.rig.net import RigError, can_build
from tests.rig.ssh import SshFleet

# A fresh fleet for each scenario (namespaces), or the same one put back in order (SSH).
Fresh = Callable[[], contextlib.AbstractContextManager[Fleet]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.rig", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="build the fleet and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=4, help="GPU hosts (one is a spare)")
    sub.add_parser("down", help="remove every run's leftovers")
    real = argparse.ArgumentParser(add_help=False)
    g = real.add_argument_group("real hosts over SSH (docs/rig.md)")
    g.add_argument("--inventory", type=Path, help="an Ansible INI inventory of the fleet")
    g.add_argument(
        "--converge", action="store_true", help="run ansible-playbook ansible/site.yml first"
    )
    g.add_argument(
        "--ansible-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for ansible-playbook (e.g. --ansible-arg=--vault-password-file=F)",
    )
    g.add_argument("--api", help="the supervisor's API URL (default: its supervisor.toml's)")
    g.add_argument("--token-file", type=Path, help="the API token (default: the supervisor's)")
    g.add_argument(
        "--ca",
        type=Path,
        help="the CA of an HTTPS API's certificate (default: the supervisor's agent_ca_file)",
    )
    g.add_argument(
        "--object-store-unit",
        metavar="HOST:UNIT",
        help="the object store's systemd unit, which object-store-down freezes",
    )
    run = sub.add_parser("run", parents=[real], help="run fault scenarios, one JSON object each")
    run.add_argument("--fault", action="append", required=True, choices=[*FAULTS, "all"])
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--trials", type=int, default=1, help="seeds seed, seed+1, ...")
    run.add_argument("-o", dest="output", choices=["json", "text"], default="json")
    sub.add_parser("list", help="the fault kinds and what each expects")
    so = sub.add_parser(
        "soak", parents=[real], help="one long job, faults at random at a given MTBF"
    )
    so.add_argument("--mtbf", type=float, default=120.0, help="mean seconds between faults")
    so.add_argument("--minutes", type=float, default=10.0)
    so.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.verb == "list":
        for f in FAULTS.values():
            print(f"{f.kind:20} {f.expect_state:10} {f.recovery:9} {f.what}")
        return 0
    if args.verb == "down":
        print(json.dumps(down_all()))
        return 0
    if getattr(args, "inventory", None) is not None:
        try:
            with _ssh_fleet(args) as fleet:
                return _drive(args, fleet.scenario, fleet.cannot)
        except KeyboardInterrupt:
            return 130
        except RigError as exc:
            print(f"rig: {exc}", file=sys.stderr)
            return 1
    why = can_build()
    if why is not None:
        print(f"rig: cannot run here: {why}", file=sys.stderr)
        return 2
    try:
        if args.verb == "up":
            with RigFleet.running(gpu_hosts=args.hosts) as fleet:
                print(
                    json.dumps(
                        {
                            "dir": str(fleet.dir),
                            "api": f"http://{fleet.control.address}:8740",
                            "token": fleet.token,
                            "hosts": {h.name: h.address for h in fleet.hosts},
                        }
                    ),
                    flush=True,
                )
                while True:
                    time.sleep(3600)
        # A fresh fleet per scenario: nothing a fault left (a quarantined node, a node's
        # failure history) weighs on the next one.
        return _drive(args, RigFleet.running, lambda kind: None)
    except KeyboardInterrupt:
        return 130
    except RigError as exc:
        print(f"rig: {exc}", file=sys.stderr)
        return 1


def _drive(args: Any, fresh: Fresh, cannot: Callable[[str], str | None]) -> int:
    """``run`` or ``soak`` on the fleets ``fresh`` opens; ``cannot`` says which faults
    these fleets cannot strike (named: refused before anything runs; of ``all``: skipped,
    each with a line that says why)."""
    if args.verb == "soak":
        with fresh() as fleet:
            print(json.dumps(soak(fleet, args.minutes, args.mtbf, args.seed)), flush=True)
        return 0
    kinds = list(FAULTS) if "all" in args.fault else args.fault
    refused = {k: why for k in kinds if (why := cannot(k)) is not None}
    if refused and "all" not in args.fault:
        for kind, why in refused.items():
            print(f"rig: {kind} cannot run on this fleet: {why}", file=sys.stderr)
        return 2
    failed = 0
    with fresh() as fleet:
        baseline = undisturbed(fleet)
    print(json.dumps({"undisturbed": baseline}), flush=True)
    for kind in kinds:
        if kind in refused:
            print(json.dumps({"fault": kind, "skipped": refused[kind]}), flush=True)
            continue
        results = []
        for trial in range(args.trials):
            with fresh() as fleet:
                result = run_scenario(fleet, kind, args.seed + trial, baseline)
            results.append(result)
            failed += not result["as_expected"]
            print(json.dumps(result), flush=True)
        if args.trials > 1:
            print(json.dumps({"summary": summary(results)}), flush=True)
    return 1 if failed else 0


def _ssh_fleet(args: Any) -> SshFleet:
    unit = None
    if args.object_store_unit:
        host, sep, name = args.object_store_unit.partition(":")
        if not sep or not host or not name:
            raise RigError(f"--object-store-unit {args.object_store_unit!r}: expected HOST:UNIT")
        unit = (host, name)
    token = args.token_file.read_text().strip() if args.token_file else None
    return SshFleet.from_inventory(
        args.inventory,
        converge=args.converge,
        ansible_args=args.ansible_arg,
        api=args.api,
        token=token,
        ca_file=args.ca,
        object_store_unit=unit,
    )


if __name__ == "__main__":
    sys.exit(main())
