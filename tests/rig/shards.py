"""The bytes a fault reaches into: a rank's RAM-tier slots (their header says which step a
slot holds, sealed or not) and one byte flipped in a file.

The functions work on this machine's files (the namespace fleet); :data:`REMOTE` is the
same code as a script for ``python3 -c`` on a real host (the SSH fleet), so both fleets
read a slot and flip a byte the same way.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from tests.rig.net import RigError

RAM_HEADER_NBYTES = 4096  # ckpt.ram: a slot's header page, then the shard
SLOT_HEAD_FORMAT = "<8sIIqQQQ16s"  # magic, version, state, step, nbytes, cap, seq, digest
_SLOT_HEAD = struct.Struct(SLOT_HEAD_FORMAT)
SEALED = 2


def newest_slot(shm: Path, job: str, rank: int) -> tuple[Path, int, int]:
    """The slot holding the rank's newest sealed shard: (path, step, shard bytes)."""
    best: tuple[int, Path, int] | None = None
    for path in shm.glob(f"phalanx-{job}-r{rank}.slot*"):
        with path.open("rb") as fh:
            _magic, _version, state, step, nbytes, _cap, _seq, _digest = _SLOT_HEAD.unpack(
                fh.read(_SLOT_HEAD.size)
            )
        if state == SEALED and (best is None or step > best[0]):
            best = (step, path, nbytes)
    if best is None:
        raise RigError(f"no sealed RAM slot of rank {rank} of {job} in {shm}")
    return best[1], best[0], best[2]


def flip(path: Path, start: int, nbytes: int) -> None:
    """Invert the byte in the middle of the ``nbytes`` of payload at ``start``."""
    with path.open("r+b") as fh:
        fh.seek(start + nbytes // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


# ``python3 -c REMOTE slot SHM JOB RANK`` prints "PATH STEP NBYTES" of the newest sealed
# slot (exit 3: none); ``python3 -c REMOTE flip PATH OFFSET`` inverts the byte at OFFSET;
# ``python3 -c REMOTE newstep DIR TIMEOUT`` prints the first new entry of DIR (a step being
# written down) within TIMEOUT seconds, or nothing.
REMOTE = f"""\
import os, struct, sys, time
from pathlib import Path
verb, args = sys.argv[1], sys.argv[2:]
if verb == "slot":
    head = struct.Struct({SLOT_HEAD_FORMAT!r})
    best = None
    for p in Path(args[0]).glob("phalanx-" + args[1] + "-r" + args[2] + ".slot*"):
        with p.open("rb") as fh:
            f = head.unpack(fh.read(head.size))
        if f[2] == {SEALED} and (best is None or f[3] > best[0]):
            best = (f[3], p, f[4])
    if best is None:
        sys.exit(3)
    print(best[1], best[0], best[2])
elif verb == "flip":
    with open(args[0], "r+b") as fh:
        fh.seek(int(args[1]))
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))
elif verb == "newstep":
    d = Path(args[0])
    ls = lambda: {{p.name for p in d.glob("*")}} if d.is_dir() else set()
    before, end = ls(), time.monotonic() + float(args[1])
    while time.monotonic() < end:
        new = ls() - before
        if new:
            print(sorted(new)[-1])
            break
        time.sleep(0.005)
"""
