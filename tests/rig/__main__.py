"""``python -m tests.rig``: the fault-injection rig's one entry point (run as root).

python -m tests.rig up [--hosts 4]          build the fleet, print where it is, wait
python -m tests.rig down                    remove what any run left on this machine
python -m tests.rig run --fault KIND [--seed S] [--trials N] [-o json]
python -m tests.rig soak --mtbf 120 --minutes 10 [--seed S]
python -m tests.rig list                    the fault kinds and what each expects
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from tests.rig.driver import run_scenario, soak, summary, undisturbed
from tests.rig.faults import FAULTS
from tests.rig.fleet import RigFleet, down_all
from tests.rig.net import RigError, can_build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.rig", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="build the fleet and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=4, help="GPU hosts (one is a spare)")
    sub.add_parser("down", help="remove every run's leftovers")
    run = sub.add_parser("run", help="run fault scenarios, one JSON object each")
    run.add_argument("--fault", action="append", required=True, choices=[*FAULTS, "all"])
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--trials", type=int, default=1, help="seeds seed, seed+1, ...")
    run.add_argument("-o", dest="output", choices=["json", "text"], default="json")
    sub.add_parser("list", help="the fault kinds and what each expects")
    so = sub.add_parser("soak", help="one long job, faults at random at a given MTBF")
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
        removed = down_all()
        print(json.dumps({"removed": removed}))
        return 0
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
        if args.verb == "soak":
            with RigFleet.running() as fleet:
                print(json.dumps(soak(fleet, args.minutes, args.mtbf, args.seed)), flush=True)
            return 0
        if args.verb == "run":
            kinds = list(FAULTS) if "all" in args.fault else args.fault
            failed = 0
            # A fresh fleet per scenario: nothing a fault left (a quarantined node, a node's
            # failure history) weighs on the next one.
            with RigFleet.running() as fleet:
                baseline = undisturbed(fleet)
            print(json.dumps({"undisturbed": baseline}), flush=True)
            for kind in kinds:
                results = []
                for trial in range(args.trials):
                    with RigFleet.running() as fleet:
                        result = run_scenario(fleet, kind, args.seed + trial, baseline)
                    results.append(result)
                    failed += not result["as_expected"]
                    print(json.dumps(result), flush=True)
                if args.trials > 1:
                    print(json.dumps({"summary": summary(results)}), flush=True)
            return 1 if failed else 0
    except KeyboardInterrupt:
        return 130
    except RigError as exc:
        print(f"rig: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
