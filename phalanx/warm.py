"""A warm interpreter: a Python process that imports a job's modules ahead of time and
waits to become one of its ranks (the job spec's ``restart.warm``).

The agent (``agentd.warm``) starts it as ``PYTHON -c CODE FD IMPORTS [PAD]``, with the
Python, working directory and environment the slot's rank would be started with. It
imports IMPORTS (comma-separated), says ``ready`` on the socket FD, and waits for one
order, a JSON object followed by the end of the stream::

    {"argv": [the rank's command], "env": {...}, "cwd": "...", "log": "...",
     "script": "train.py" | null, "module": "pkg.train" | null}

Then it becomes the rank, as ``python script.py ...`` or ``python -m module ...`` would
have started: its output appended to the rank's log, its working directory, environment,
``sys.argv``, ``sys.orig_argv`` and ``sys.path[0]`` those of the command, and
``/proc/self/cmdline`` and ``/proc/self/environ`` rewritten in place to show them (``ps``,
``pgrep -f`` and an agent reaping orphans by their environment see the rank); then it
runs the script in ``__main__`` (its ``__file__`` absolute, as Python sets it) or the
module as ``python -m`` does (``runpy``). An uncaught exception prints the traceback of
the script's own frames and exits 1; ``SystemExit`` exits as it says.

What a rank can observe differently from a cold launch: ``sys.modules`` already holds
the warm imports (and this module, ``json``, ``socket``, ``ctypes``); its process started
earlier (``/proc/self/stat``, ``psutil.Process().create_time()``) and has used CPU time
importing; the imports ran with the previous generation's values of the per-rank
variables (``RANK``, ``MASTER_PORT``, ...) and with ``sys.path[0]`` the working
directory; ``/proc/self/cmdline`` and ``environ`` may end in NUL bytes of padding; an
uncaught ``KeyboardInterrupt`` ends it by SIGINT without the interpreter's finalisation.
Its parent is the agent, its session its own, as for a cold launch.

An end of stream without an order (the agent let it go, or died) ends it with exit 0.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import socket
import sys
from typing import Any, Final

__all__ = ["CODE", "READY", "main"]

# What the agent runs with ``-c``: this module's main.
CODE: Final = "import phalanx.warm as w; w.main()"
READY: Final = b"ready\n"
MAX_ORDER_BYTES: Final = 64 << 20


def main() -> None:
    fd, imports = int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m]
    sock = socket.socket(fileno=fd)
    for name in imports:
        importlib.import_module(name)  # a failure: its traceback, exit 1, before ready
    sock.sendall(READY)
    data = _read_order(sock)
    sock.close()
    if not data:
        sys.stdout.flush()
        os._exit(0)  # let go before becoming anything: nothing to finalise
    become(json.loads(data))


def _read_order(sock: socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ORDER_BYTES:
            raise ValueError(f"an order of over {MAX_ORDER_BYTES} bytes")
    return b"".join(chunks)


def become(order: dict[str, Any]) -> None:
    """Become the rank ``order`` describes and run it (see the module docstring)."""
    argv: list[str] = order["argv"]
    env: dict[str, str] = order["env"]
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(order["cwd"])
    _set_environment(env)
    show(argv, env)
    sys.orig_argv = list(argv)
    importlib.invalidate_caches()  # files made since the imports (the cwd is new)
    if order.get("module"):
        sys.argv = ["-m", *argv[3:]]
        if not sys.flags.safe_path and sys.path and sys.path[0] == "":
            sys.path[0] = os.getcwd()
        import runpy

        _run(lambda: runpy._run_module_as_main(order["module"], alter_argv=True))  # type: ignore[attr-defined]
        return
    script: str = order["script"]
    sys.argv = argv[1:]
    path = os.path.abspath(script)
    if not sys.flags.safe_path and sys.path and sys.path[0] == "":
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        print(
            f"{argv[0]}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
            file=sys.stderr,
        )
        sys.exit(2)
    _run(lambda: _run_script(path, source))


def _run_script(path: str, source: bytes) -> None:
    from importlib.machinery import SourceFileLoader

    import __main__

    namespace = __main__.__dict__
    builtins = namespace["__builtins__"]
    namespace.clear()
    namespace.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __spec__=None,
        __annotations__={},
        __builtins__=builtins,
        __file__=path,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", path),
    )
    exec(compile(source, path, "exec", dont_inherit=True), namespace)


def _run(target: Any) -> None:
    """Run the rank; an uncaught exception is printed as the interpreter prints it, without
    this module's frames, and exits as it would."""
    try:
        target()
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        # Drop the frames of this module (this function's and the runner's).
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.stderr.flush()
        if isinstance(exc, KeyboardInterrupt):
            sys.stdout.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None


def _set_environment(env: dict[str, str]) -> None:
    """Replace the whole process environment, the C library's included: after this no
    pointer of ``environ`` refers to the strings the process was started with."""
    libc = ctypes.CDLL(None)
    libc.clearenv()
    os.environ.clear()
    os.environ.update(env)


def _regions() -> tuple[int, int, int, int]:
    """arg_start, arg_end, env_start, env_end of this process (proc(5), fields 48-51)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b") ", 1)[1].split()
    start = 3  # fields[0] is field 3, the state
    return (
        int(fields[48 - start]),
        int(fields[49 - start]),
        int(fields[50 - start]),
        int(fields[51 - start]),
    )


def show(argv: list[str], env: dict[str, str]) -> bool:
    """Rewrite the memory ``/proc/self/cmdline`` and ``/proc/self/environ`` read to hold
    ``argv`` and ``env``, NUL-padded; False (each left as it was) where one does not fit
    or this is no Linux. Call it only once :func:`_set_environment` let go of the old
    strings."""
    try:
        arg_start, arg_end, env_start, env_end = _regions()
    except (OSError, IndexError, ValueError):
        return False
    args = b"".join(os.fsencode(a) + b"\0" for a in argv)
    variables = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    shown = True
    for start, end, data in ((arg_start, arg_end, args), (env_start, env_end, variables)):
        size = end - start
        if start <= 0 or len(data) > size:
            shown = False
            continue
        ctypes.memmove(start, data + bytes(size - len(data)), size)
    return shown
