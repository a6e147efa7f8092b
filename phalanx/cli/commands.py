"""``phalanx``: the operator's command line.

The fleet commands talk to the supervisor's REST API at ``$PHALANX_API`` with
the token ``$PHALANX_TOKEN`` (or ``--api`` / ``--token-file``; ``--token`` works too,
but shows the token to every user of the machine in ``ps``); an ``https://`` API is
verified against the CA in ``$PHALANX_CA`` (or ``--ca``), else the system's CA
store. ``eval "$(phalanx local env)"`` sets them for a local fleet. A token has a role
(viewer, member of a team, operator, admin); an admin makes them with ``phalanx token``
(:mod:`phalanx.cli.tokens`). Tables go to stdout by default,
stable JSON with ``-o json``; messages go to stderr.

``phalanx agent-token --secret-file S NODE`` needs no API: it prints the node's agent
token derived from the fleet agent secret (``phalanx.agent_tokens``).

Exit codes:
  0  success
  1  the supervisor failed, could not be reached, or refused the token (wrong, expired,
     revoked)
  2  bad usage (arguments, missing API settings)
  3  not found (an unknown node, no local fleet)
  4  refused (e.g. undraining a node that still reports drain reasons, or a request
     outside the token's role)
  5  `submit --wait`: the job ended failed or cancelled, or can never start on this fleet
     (it needs more nodes, GPUs or racks than the fleet has, even with every node back);
     `sweep submit --wait`: the sweep ended without a best trial
  141  stdout was a pipe its reader closed (`phalanx local env | head -1`): nothing is
     printed about it, as with other Unix tools
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx import agent_tokens, local
from phalanx.cli import charts, top
from phalanx.cli import local as cli_local
from phalanx.cli import sweeps as cli_sweeps
from phalanx.cli import tokens as cli_tokens
from phalanx.cli.base import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
)
from phalanx.cli.base import (
    emit as _emit,
)
from phalanx.cli.base import (
    table as _table,
)
from phalanx.cli.incidents import ettr_text, incident_lines
from phalanx.client import ApiError, Client
from phalanx.jobspec import JobSpec, JobSpecError, load_spec_file
from phalanx.lineage import code_ref_of


def _client(args: argparse.Namespace) -> Client:
    api = args.api or os.environ.get("PHALANX_API")
    token = args.token or _token_file(args.token_file) or os.environ.get("PHALANX_TOKEN")
    if not api or not token:
        raise CliError(
            "no supervisor configured: set PHALANX_API and PHALANX_TOKEN (for a local "
            'fleet: eval "$(phalanx local env)"), or pass --api and --token-file',
            EXIT_USAGE,
        )
    ca = args.ca or os.environ.get("PHALANX_CA") or None
    try:
        return Client(api, token, ca_file=Path(ca) if ca else None)
    except ApiError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _token_file(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--token-file: cannot read {path}: {exc}", EXIT_USAGE) from None
    if not token:
        raise CliError(f"--token-file: {path} is empty", EXIT_USAGE)
    return token


def _call(fn: Any, *a: Any) -> Any:
    try:
        return fn(*a)
    except ApiError as exc:
        code = {
            404: EXIT_NOT_FOUND,
            409: EXIT_REFUSED,
            403: EXIT_REFUSED,
            400: EXIT_USAGE,
        }.get(exc.status, EXIT_FAILED)
        raise CliError(str(exc), code) from None


def _reasons(node: dict[str, Any]) -> str:
    codes = [
        r["code"] + (f"(gpu{r['gpu']})" if r.get("gpu") is not None else "")
        for r in node["reasons"]
    ]
    drain = node.get("drain")
    if drain and drain["by"] == "operator":
        codes.append(f"operator: {drain['reason']}")
    return ", ".join(codes) or "-"


def cmd_nodes(args: argparse.Namespace) -> int:
    nodes = _call(_client(args).get, "/v1/nodes")
    rows = [
        [
            n["id"],
            n["state"] + (" (spare)" if n.get("spare") else ""),
            n["rack"] or "-",
            str(n["gpu_count"]),
            ",".join(n.get("jobs", [])) or "-",
            _reasons(n),
        ]
        for n in nodes
    ]
    _emit(args, nodes, _table(rows, ["NODE", "STATE", "RACK", "GPUS", "JOBS", "REASONS"]))
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
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"])),
            e["node"] or "-",
            e["kind"],
            _detail(e["detail"]),
        ]
        for e in events
    ]
    _emit(args, events, _table(rows, ["TIME", "NODE", "EVENT", "DETAIL"]))
    return EXIT_OK


def _detail(detail: dict[str, Any]) -> str:
    parts = []
    for key, value in detail.items():
        if key == "reasons":
            value = ",".join(r["code"] for r in value) or "-"
        parts.append(f"{key}={value}")
    return " ".join(parts)


# --- jobs ---------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    def token_team() -> str | None:  # a spec without a team: the token's (as the server)
        team: str | None = _call(_client(args).get, "/v1/whoami").get("team")
        return team

    try:
        spec = load_spec_file(Path(args.spec), default_team=token_team)
    except JobSpecError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    client = _client(args)
    body = spec.model_dump(mode="json")
    if not Path(spec.workdir).is_absolute():  # relative to the spec file, as a user reads it
        body["workdir"] = str((Path(args.spec).parent / spec.workdir).resolve())
    if args.code_ref:
        body["code_ref"] = {"commit": args.code_ref, "dirty": False}
    elif spec.code_ref is None:
        body["code_ref"] = code_ref_of(Path(body["workdir"]))
    job = _call(client.post, "/v1/jobs", {"spec": body})
    print(job["id"])
    print(f"submitted {job['id']} ({spec.world_size} ranks on {spec.nodes} nodes)", file=sys.stderr)
    if spec.elastic is not None:
        print(elastic_sizes_text(spec), file=sys.stderr)
    if not args.wait:
        return EXIT_OK
    final = _wait_job(client, job["id"], until_never=True)
    if final["state"] == "pending":  # it can never start: waiting would be forever
        print(
            f"phalanx: job {final['id']} {final['waiting']['detail']}; it stays pending "
            f"until the fleet grows or it is cancelled (phalanx cancel {final['id']})",
            file=sys.stderr,
        )
        return EXIT_JOB_FAILED
    print(f"job {final['id']} {final['state']}: {final['reason'] or ''}", file=sys.stderr)
    return EXIT_OK if final["state"] == "succeeded" else EXIT_JOB_FAILED


def _never_starts(job: dict[str, Any]) -> bool:
    """Whether ``job`` waits for what the fleet cannot give it: more nodes, GPUs, racks
    or a GPU type than it has even with every drained, offline or spare node back
    (the scheduler's "can never start"). sbatch would refuse such a job."""
    waiting = job.get("waiting") or {}
    detail = str(waiting.get("detail") or "")
    return job["state"] == "pending" and detail.startswith("can never start")


def _wait_job(client: Client, job_id: str, *, until_never: bool = False) -> dict[str, Any]:
    """Poll the job until it ends; with ``until_never``, also until it is pending with no
    chance to start (`_never_starts`), and return it then."""
    last_state = None
    while True:
        job: dict[str, Any] = _call(client.get, f"/v1/jobs/{job_id}")
        if job["state"] != last_state:
            waiting = job.get("waiting") or {}
            extra = (
                f" ({waiting['reason']}: {waiting['detail']})"
                if waiting and job["state"] == "pending"
                else ""
            )
            print(f"job {job_id}: {job['state']}{extra}", file=sys.stderr)
            last_state = job["state"]
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        if until_never and _never_starts(job):
            return job
        time.sleep(0.5)


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    s = int(time.time() - ts)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cmd_top(args: argparse.Namespace) -> int:
    client = _client(args)

    def fetch() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return _call(client.get, "/v1/nodes"), _call(client.get, "/v1/jobs")

    once = args.once or not sys.stdout.isatty()
    top.run(fetch, interval_s=args.interval, frames=1 if once else None, clear=not once)
    return EXIT_OK


def cmd_jobs(args: argparse.Namespace) -> int:
    query = {
        key: value
        for key, value in (
            ("state", args.state),
            ("team", args.team),
            ("limit", None if args.limit is None else str(args.limit)),
            ("before", args.before),
        )
        if value is not None
    }
    path = "/v1/jobs" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    jobs, more = _call(_client(args).get_page, path)
    if more is not None:  # a page, newest first: say how to get the next one
        print(
            f"phalanx: more jobs: phalanx jobs{_page_args(args)} --before {more}",
            file=sys.stderr,
        )
    rows = []
    for j in jobs:
        note = j["reason"] or ""
        if j["state"] in ("pending", "recovering") and j.get("waiting"):
            note = f"{j['waiting']['reason']}: {j['waiting']['detail']}"
        restarts = f"{j.get('restarts', 0)}/{j.get('max_restarts', '-')}"
        rows.append(
            [
                j["id"],
                j["state"],
                j["team"],
                str(j["priority"]),
                str(j["world_size"]),
                str(j["generation"]),
                restarts,
                ",".join(j["nodes"]) or "-",
                _age(j["submitted_at"]),
                note or "-",
            ]
        )
    _emit(
        args,
        jobs,
        _table(
            rows,
            ["JOB", "STATE", "TEAM", "PRIO", "RANKS", "GEN", "RESTARTS", "NODES", "AGE", "REASON"],
        ),
    )
    return EXIT_OK


def _page_args(args: argparse.Namespace) -> str:
    """``phalanx jobs``' filter and limit options, as typed again for the next page."""
    return "".join(
        f" --{name} {shlex.quote(str(value))}"
        for name, value in (("state", args.state), ("team", args.team), ("limit", args.limit))
        if value is not None
    )


def elastic_sizes_text(spec: JobSpec) -> str:
    """What an elastic spec allows: each size, its data-parallel size and accumulation."""
    e = spec.elastic
    assert e is not None
    per = spec.ranks_per_node
    sizes = ", ".join(
        f"{n} ({n * per} ranks, accumulation {e.accumulation(n, per)})"
        for n in spec.elastic_sizes()
    )
    return (
        f"elastic: global batch {e.global_batch} in micro batches of {e.micro_batch}; "
        f"allowed sizes in nodes: {sizes}"
    )


def cmd_status(args: argparse.Namespace) -> int:
    j = _call(_client(args).get, f"/v1/jobs/{args.job}")
    lines = [
        f"job:         {j['id']} ({j['name']}, team {j['team']}, priority {j['priority']})",
        f"state:       {j['state']}" + (f" — {j['reason']}" if j["reason"] else ""),
        f"world size:  {j['world_size']}   generation: {j['generation']}   "
        f"master: {j['master'] or '-'}",
    ]
    if (e := j.get("elastic")) is not None:
        lines.append(
            f"elastic:     {e['nodes']} of {e['of_nodes']} nodes (min {e['min_nodes']}), "
            f"data-parallel {e['dp_size']}, global batch {e['global_batch']} = micro batch "
            f"{e['micro_batch']} x {e['dp_size']} x accumulation {e['accumulation']}"
        )
    if j.get("waiting") and j["state"] in ("pending", "recovering"):
        lines.append(f"waiting:     {j['waiting']['reason']}: {j['waiting']['detail']}")
    first, this = j.get("first_started_at") or j["started_at"], j["started_at"]
    lines.append(
        f"submitted:   {_when(j['submitted_at'])}   started: {_when(first)}"
        + (f" (generation {j['generation']}: {_when(this)})" if this and this != first else "")
        + f"   ended: {_when(j['ended_at'])}"
    )
    if (ettr := ettr_text(j.get("goodput") or {})) is not None:
        rollbacks = f"rollbacks: {j['rollbacks']}   " if j.get("rollbacks") else ""
        lines.append(
            f"restarts:    {j.get('restarts', 0)} of {j.get('max_restarts')}   {rollbacks}{ettr}"
        )
    for incident in j.get("incidents") or []:
        lines.extend(incident_lines(incident))
    if (training := charts.summary_line(j.get("summary"))) is not None:
        lines.append(f"training:    {training}")
        lines.extend(f"             {s}" for s in charts.straggler_lines(j["summary"]))
    if j.get("recovery"):
        rec = j["recovery"]
        plan = rec.get("plan") or {}
        lines.append(
            f"recovering:  generation {rec.get('generation')}: "
            f"{plan.get('reason') or rec.get('phase')}"
        )
    rows = [
        [
            str(r["rank"]),
            r["node"],
            str(r["local_rank"]),
            "lost"
            if r["lost"]
            else (
                "-"
                if r["exit_code"] is None and r["signal"] is None
                else (f"signal {r['signal']}" if r["signal"] is not None else str(r["exit_code"]))
            ),
        ]
        for r in j["ranks"]
    ]
    table = "\n".join(lines)
    if rows:
        table += "\n\n" + _table(rows, ["RANK", "NODE", "LOCAL", "EXIT"])
    _emit(args, j, table)
    return EXIT_OK


def _when(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _call(_client(args).post, f"/v1/jobs/{args.job}/cancel")
    print(f"cancelling {job['id']} ({job['state']})", file=sys.stderr)
    if args.wait:
        final = _wait_job(_client(args), job["id"])
        return EXIT_OK if final["state"] == "cancelled" else EXIT_FAILED
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    offset = 0
    while True:
        data, offset = _call(
            client.get_bytes, f"/v1/jobs/{args.job}/logs?rank={args.rank}&offset={offset}"
        )
        if data:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
            continue
        if not args.follow:
            return EXIT_OK
        job = _call(client.get, f"/v1/jobs/{args.job}")
        if job["state"] in ("succeeded", "failed", "cancelled", "pending"):
            return EXIT_OK
        time.sleep(0.5)


def cmd_metrics(args: argparse.Namespace) -> int:
    query = f"?names={urllib.parse.quote(args.names, safe=',')}" if args.names else ""
    data = _call(_client(args).get, f"/v1/jobs/{args.job}/metrics{query}")
    _emit(args, data, charts.metrics_table(data, width=args.width))
    return EXIT_OK


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def cmd_ckpt_ls(args: argparse.Namespace) -> int:
    cat = _call(_client(args).get, f"/v1/jobs/{args.job}/checkpoints")
    rows = []
    for s in reversed(cat["steps"]):
        committed = [t for t in cat["tiers"] if t in s["committed"]]
        committed += [t for t in s["committed"] if t not in committed]
        partial = [f"{t}({n}/{cat['world_size']})" for t, n in sorted(s["partial"].items())]
        size = max(s["bytes"].values(), default=0)
        loss = s.get("loss")
        rows.append(
            [
                str(s["step"]),
                ",".join(committed) or "-",
                " ".join(partial) or "-",
                _size(size),
                f"{loss:.4g}" if isinstance(loss, int | float) else str(loss or "-"),
            ]
        )
    table = _table(rows, ["STEP", "COMMITTED", "PARTIAL", "SIZE", "LOSS"])
    _emit(args, cat, "\n".join([*charts.lineage_lines(cat.get("lineage") or {}), table]))
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx",
        description="Operate a Phalanx fleet.",
        epilog="exit codes: 0 ok, 1 supervisor failed or unreachable, 2 bad usage, "
        "3 not found, 4 refused, 5 the waited-for job did not succeed",
    )
    p.add_argument("--api", help="supervisor URL (default: $PHALANX_API)")
    given = p.add_mutually_exclusive_group()
    given.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding the API token (default: $PHALANX_TOKEN)",
    )
    given.add_argument(
        "--token",
        help="API token; every user of this machine sees it in ps: prefer $PHALANX_TOKEN "
        "or --token-file",
    )
    p.add_argument(
        "--ca",
        help="CA bundle (PEM) that signed the supervisor's certificate, for an https:// API "
        "(default: $PHALANX_CA, else the system's CA store)",
    )
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
    sp.add_argument(
        "--force",
        action="store_true",
        help="undrain even while the node still reports drain reasons",
    )
    out(sp)
    sp.set_defaults(fn=cmd_undrain)
    sp = sub.add_parser("events", help="the fleet's event log, oldest first")
    sp.add_argument("--node")
    sp.add_argument("--limit", type=int, default=50)
    out(sp)
    sp.set_defaults(fn=cmd_events)

    sp = sub.add_parser("submit", help="submit a job spec (YAML); prints the job id")
    sp.add_argument("spec")
    sp.add_argument(
        "--wait",
        action="store_true",
        help="wait for the job to end; exit 0 if it succeeded, 5 otherwise (it failed, was "
        "cancelled, or can never start on this fleet)",
    )
    sp.add_argument(
        "--code-ref",
        metavar="REF",
        help="the code version to record with the job (default: the spec's code_ref, else "
        "the git commit of its workdir and whether the tree was dirty)",
    )
    sp.set_defaults(fn=cmd_submit)
    sp = sub.add_parser("top", help="the fleet and its jobs, refreshed in place (Ctrl-C quits)")
    sp.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    sp.add_argument("--once", action="store_true", help="print one frame and exit")
    sp.set_defaults(fn=cmd_top)
    sp = sub.add_parser(
        "jobs",
        help="list jobs, their state and why pending ones wait (every job, oldest first; "
        "with --limit or --before a page, newest first)",
    )
    sp.add_argument("--state", help="comma-separated states, e.g. running,pending")
    sp.add_argument("--team", help="only this team's jobs")
    sp.add_argument("--limit", type=int, help="at most N jobs, newest submitted first")
    sp.add_argument("--before", metavar="CURSOR", help="the page after the one that said so")
    out(sp)
    sp.set_defaults(fn=cmd_jobs)
    sp = sub.add_parser("status", help="one job: state, rank map, exit codes")
    sp.add_argument("job")
    out(sp)
    sp.set_defaults(fn=cmd_status)
    sp = sub.add_parser("cancel", help="stop every rank of a job")
    sp.add_argument("job")
    sp.add_argument("--wait", action="store_true")
    sp.set_defaults(fn=cmd_cancel)
    sp = sub.add_parser("logs", help="a rank's output, fetched from its node")
    sp.add_argument("job")
    sp.add_argument("--rank", type=int, default=0)
    sp.add_argument("-f", "--follow", action="store_true")
    sp.set_defaults(fn=cmd_logs)

    sp = sub.add_parser("metrics", help="a job's training metrics: latest values and charts")
    sp.add_argument("job")
    sp.add_argument("--names", help="comma-separated series (default: every one)")
    sp.add_argument("--width", type=int, default=40, help="chart width in characters")
    out(sp)
    sp.set_defaults(fn=cmd_metrics)

    cp = sub.add_parser("ckpt", help="a job's checkpoints")
    csub = cp.add_subparsers(dest="ckpt_command", required=True)
    sp = csub.add_parser("ls", help="steps, newest first, and the tiers holding each")
    sp.add_argument("job")
    out(sp)
    sp.set_defaults(fn=cmd_ckpt_ls)

    cli_tokens.add_parser(sub, out, _client, _call)
    cli_sweeps.add_parser(sub, out, _client, _call)
    cli_local.add_parser(sub, out)
    agent_tokens.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except BrokenPipeError:
        return _reader_gone()


def _run(argv: Sequence[str] | None) -> int:
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


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``| head``). Python flushes stdout once more at
    exit, which would fail again and print "Exception ignored ... BrokenPipeError":
    stdout is pointed at /dev/null first, so the command ends quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
