"""``phalanx``: the operator's command line and its tools.

* `commands` — the parser, ``main()`` and the job, node, event and metrics commands;
* `base` — exit codes, the error that carries one, ``-o json`` output and tables;
* `local` — ``phalanx local``: a whole fleet on this machine;
* `tokens` — ``phalanx token``: an admin's API tokens;
* `top` — ``phalanx top``, the fleet in one refreshing screen;
* `charts` — text charts for ``phalanx metrics`` and ``phalanx status``.

``python -m phalanx.cli`` runs it as the ``phalanx`` script does.
"""

from phalanx.cli.commands import main

__all__ = ["main"]
