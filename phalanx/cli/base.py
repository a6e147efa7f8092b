"""What the ``phalanx`` commands share: exit codes, the error that carries one, and
output as a table or JSON (``-o``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4
EXIT_JOB_FAILED = 5
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`'s yes


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=False)).rstrip()
        for r in [headers, *rows]
    ]
    return "\n".join(lines)


def emit(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(table)
