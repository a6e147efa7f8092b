"""``phalanx sweep``: submit a hyperparameter sweep, list sweeps, show one, cancel one
(the supervisor's ``/v1/sweeps``; the spec: :mod:`phalanx.sweepspec`).

``submit`` prints the sweep's id on stdout; ``--wait`` follows it until it ends and
exits 0 when it completed with a best trial, 5 otherwise. ``status -o json`` gives the
sweep's ``state``, its ``best`` trial and its ``trials``, each with its ``number``,
``state`` (``running``, ``complete``, ``pruned``, ``failed``), ``params``, ``value`` and
``job``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.cli.base import EXIT_JOB_FAILED, EXIT_OK, EXIT_USAGE, CliError, emit, table
from phalanx.client import Client
from phalanx.lineage import code_ref_of
from phalanx.sweepspec import SweepSpecError, format_value, load_sweep_file

ClientOf = Callable[[argparse.Namespace], Client]
Call = Callable[..., Any]


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "-" if value is None else str(value)


def _params(params: dict[str, Any]) -> str:
    return (
        " ".join(
            f"{k}={f'{v:.4g}' if isinstance(v, float) else format_value(v)}"
            for k, v in params.items()
        )
        or "-"
    )


def _counts(s: dict[str, Any]) -> str:
    c = s["counts"]
    return (
        f"{c.get('complete', 0)} done, {c.get('pruned', 0)} pruned, {c.get('failed', 0)} failed, "
        f"{c.get('running', 0)} running of {s['n_trials']}"
    )


def status_text(s: dict[str, Any]) -> str:
    """A sweep as ``phalanx sweep status`` prints it: a summary, then its trials."""
    obj = s["objective"]
    best = s.get("best")
    lines = [
        f"sweep:      {s['id']} (team {s['team']}, priority {s['priority']})",
        f"state:      {s['state']}" + (f": {s['reason']}" if s.get("reason") else ""),
        f"objective:  {obj['direction']} {obj['metric']} ({obj['at']})   "
        f"sampler: {s['sampler']['type']}   pruner: {s['pruner']['type']}",
        f"trials:     {_counts(s)}, {s['parallelism']} at once",
        "best:       "
        + (
            f"trial {best['number']}: {_value(best['value'])}  {_params(best['params'])}  "
            f"(job {best['job']})"
            if best
            else "-"
        ),
    ]
    rows = [
        [
            str(t["number"]),
            t["state"] + (f" @{t['pruned_at']}" if t.get("pruned_at") is not None else ""),
            _value(t["value"]),
            _params(t["params"]),
            t.get("job") or "-",
            t.get("reason") or "-",
        ]
        for t in s.get("trials", [])
    ]
    text = "\n".join(lines)
    if rows:
        text += "\n\n" + table(rows, ["TRIAL", "STATE", "VALUE", "PARAMS", "JOB", "REASON"])
    return text


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    out: Callable[[argparse.ArgumentParser], None],
    client_of: ClientOf,
    call: Call,
) -> None:
    """The ``sweep`` command and its subcommands, under ``sub``; ``client_of`` makes the
    API client of the parsed arguments, ``call`` maps an API error to an exit code."""

    def cmd_submit(args: argparse.Namespace) -> int:
        def token_team() -> str | None:
            team: str | None = call(client_of(args).get, "/v1/whoami").get("team")
            return team

        path = Path(args.spec)
        try:
            spec = load_sweep_file(path, default_team=token_team)
        except SweepSpecError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        body = spec.model_dump(mode="json")
        trial = body["trial"]
        if not Path(trial["workdir"]).is_absolute():  # relative to the spec file
            trial["workdir"] = str((path.parent / trial["workdir"]).resolve())
        if trial.get("code_ref") is None:
            trial["code_ref"] = code_ref_of(Path(trial["workdir"]))
        client = client_of(args)
        made = call(client.post, "/v1/sweeps", {"spec": body})
        print(made["id"])
        print(
            f"submitted sweep {made['id']} ({spec.n_trials} trials, {spec.parallelism} at once)",
            file=sys.stderr,
        )
        if not args.wait:
            return EXIT_OK
        last = None
        while True:
            s = call(client.get, f"/v1/sweeps/{made['id']}")
            if (now := _counts(s)) != last:
                print(f"sweep {s['id']}: {s['state']}: {now}", file=sys.stderr)
                last = now
            if s["state"] != "running":
                break
            time.sleep(1.0)
        return EXIT_OK if s["state"] == "complete" and s.get("best") else EXIT_JOB_FAILED

    def cmd_ls(args: argparse.Namespace) -> int:
        found: list[dict[str, Any]] = call(client_of(args).get, "/v1/sweeps")
        rows = [
            [
                s["id"],
                s["state"],
                s["team"],
                _counts(s),
                _value((s.get("best") or {}).get("value")),
            ]
            for s in found
        ]
        emit(args, found, table(rows, ["SWEEP", "STATE", "TEAM", "TRIALS", "BEST"]))
        return EXIT_OK

    def cmd_status(args: argparse.Namespace) -> int:
        s = call(client_of(args).get, f"/v1/sweeps/{args.sweep}")
        emit(args, s, status_text(s))
        return EXIT_OK

    def cmd_cancel(args: argparse.Namespace) -> int:
        s = call(client_of(args).post, f"/v1/sweeps/{args.sweep}/cancel")
        print(f"sweep {s['id']} cancelled: {_counts(s)}", file=sys.stderr)
        emit(args, s, f"{s['id']}  {s['state']}")
        return EXIT_OK

    sp_sweep = sub.add_parser("sweep", help="hyperparameter sweeps: submit, list, status, cancel")
    ssub = sp_sweep.add_subparsers(dest="sweep_command", required=True)
    sp = ssub.add_parser("submit", help="submit a sweep spec (YAML); prints the sweep id")
    sp.add_argument("spec")
    sp.add_argument(
        "--wait",
        action="store_true",
        help="follow the sweep until it ends; exit 0 if it completed with a best trial, 5 if not",
    )
    sp.set_defaults(fn=cmd_submit)
    sp = ssub.add_parser("ls", help="every sweep: state, trials, best value")
    out(sp)
    sp.set_defaults(fn=cmd_ls)
    sp = ssub.add_parser("status", help="one sweep: its trials, their params, values, the best")
    sp.add_argument("sweep")
    out(sp)
    sp.set_defaults(fn=cmd_status)
    sp = ssub.add_parser("cancel", help="stop every running trial; no new trial starts")
    sp.add_argument("sweep")
    out(sp)
    sp.set_defaults(fn=cmd_cancel)
