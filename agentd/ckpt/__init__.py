"""The agent's checkpoint tiers: RAM slots its ranks copy into, the write-down, commits,
restores, and the two sets of routes that serve them.

* ``service`` — ``CkptService``, composed of the parts below; answers a saving rank.
* ``jobs`` — what the node knows of each job: plan, generation, the supervisor's catalog.
* ``rank_stores`` — ``RankStore``: one rank's RAM tier, engine and bookkeeping; ``RankStores``.
* ``node_tiers`` — the node's tiers below RAM (disk, object store, buddies) and their listings.
* ``commits`` — the supervisor's catalogs applied here: manifests, retention, the end of
  a job's RAM tier.
* ``restores`` — which step a rank restores from, and where its copies lie.
* ``rank_routes`` — the ranks' unix socket (``ckpt.protocol``'s models).
* ``peer_routes`` — the peer tier's objects, served to buddies on the HTTP port.
* ``host`` — what the routes need from the agent (``CkptHost``).

Commit is the supervisor's: every landing is published (``CkptLanding``), the
supervisor's catalog commits a step at a tier once every rank's shard is there and
publishes the job's ``CkptCatalog`` (retained). On a new commit the agent writes the
step's manifest at that tier and applies retention (``checkpoint.keep``): the previous
committed step is never deleted before a newer one is committed at that tier.
"""

from __future__ import annotations

from agentd.ckpt.errors import CkptRequestError
from agentd.ckpt.host import CkptHost, Progress, Standalone, Unwatched
from agentd.ckpt.peer_routes import add_peer_routes
from agentd.ckpt.rank_routes import make_rank_app, start_rank_socket
from agentd.ckpt.rank_stores import RankStore
from agentd.ckpt.service import CkptService

__all__ = [
    "CkptHost",
    "CkptRequestError",
    "CkptService",
    "Progress",
    "RankStore",
    "Standalone",
    "Unwatched",
    "add_peer_routes",
    "make_rank_app",
    "start_rank_socket",
]
