"""What a scenario needs from a fleet, whatever its hosts are made of.

Two fleets implement :class:`Fleet`: :class:`~tests.rig.fleet.RigFleet`, network namespaces
on this machine whose daemons the rig starts itself, and :class:`~tests.rig.ssh.SshFleet`,
the real hosts of an Ansible inventory, reached over SSH, whose daemons are the systemd
units ``ansible/site.yml`` installed. The faults (``faults.py``) and the driver
(``driver.py``) touch a fleet only through these methods and the hosts' shell commands
(:class:`~tests.rig.hosts.Host`), so a scenario is written once.

A fleet that cannot strike a fault says so with :class:`Unsupported` (and ahead of time
with :meth:`Fleet.cannot`), naming what it would need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import PurePath
from typing import Any

from phalanx.client import Client
from tests.rig.hosts import Host
from tests.rig.net import RigError

# The scenarios that edit the simulated GPUs' file (agentd.gpu.sim): the agents must run
# the sim backend.
SIM_GPU_FAULTS = frozenset({"ecc-dbe", "xid-79", "thermal", "double-fault", "bad-spare"})


class Unsupported(RigError):
    """This fleet cannot strike the fault; the message says why and what it would take."""


class Fleet(ABC):
    """A running fleet: a control side (broker, supervisor, object store) and GPU hosts
    with an agent each. Hosts are named by their node ids."""

    hosts: list[Any]

    # --- the hosts -------------------------------------------------------------------------

    @property
    @abstractmethod
    def gpu_hosts(self) -> list[Any]:
        """The hosts that run an agent."""

    def host(self, name: str) -> Any:
        for h in self.hosts:
            if h.name == name:
                return h
        raise RigError(f"no host {name!r} in the rig")

    @abstractmethod
    def daemon_host(self, role: str) -> Host:
        """The host that runs ``role``'s daemon (``broker`` or ``supervisor``)."""

    def data_address(self, host: Host) -> str:
        """The address the fleet's traffic (peers, ranks) reaches ``host`` at."""
        return host.address

    @abstractmethod
    def client(self) -> Client:
        """The supervisor's REST API, with the fleet's token."""

    def cannot(self, kind: str) -> str | None:
        """Why fault ``kind`` cannot be struck on this fleet, or None when it can."""
        return None

    # --- the job ---------------------------------------------------------------------------

    @abstractmethod
    def job_runtime(self) -> dict[str, str]:
        """How the rig's job runs on the GPU hosts: ``python`` (an interpreter with torch
        and phalanx) and ``workdir`` (holding ``examples/tinylm.py``)."""

    @abstractmethod
    def rank_log(self, job: dict[str, Any], rank: int) -> str:
        """Rank ``rank``'s log of the job's generation ``job["generation"]``; OSError when
        it has none (yet)."""

    @abstractmethod
    def kill_rank(self, host: Host, job_id: str, rank: int, generation: int) -> None:
        """SIGKILL the live process of the job's rank (of that generation) on ``host``."""

    @abstractmethod
    def object_shards(self, job_id: str, step: int) -> set[str]:
        """The ranks (``rank-00001``, ...) whose shard of the step is in the object tier."""

    # --- daemons ---------------------------------------------------------------------------

    @abstractmethod
    def kill(self, host: Host, role: str) -> None:
        """SIGKILL ``role``'s daemon on ``host`` (``agent``, ``broker``, ``supervisor``): a
        crash."""

    @abstractmethod
    def restart(self, host: Host, role: str) -> None:
        """Bring ``role``'s daemon on ``host`` back, as its service manager would."""

    @abstractmethod
    def stop_object_store(self) -> None:
        """Freeze the object store (SIGSTOP): every request to it hangs."""

    @abstractmethod
    def continue_object_store(self) -> None:
        """Undo :meth:`stop_object_store` (SIGCONT)."""

    # --- GPUs, disks, files, links ---------------------------------------------------------

    @abstractmethod
    def inject_gpu(self, host: Host, gpu: int, fault: str) -> None:
        """Apply a sim-GPU fault (``phalanx.simgpu.FAULTS``) to GPU ``gpu`` of ``host``."""

    @abstractmethod
    def nvme(self, host: Host) -> PurePath:
        """The agent's NVMe tier on ``host`` (``DATA_DIR/ckpt``)."""

    @abstractmethod
    def fill_disk(self, host: Host) -> int:
        """Fill the filesystem of the NVMe tier to the last byte; the bytes left free."""

    @abstractmethod
    def unfill_disk(self, host: Host) -> None:
        """Undo :meth:`fill_disk` (never raises)."""

    @abstractmethod
    def wait_new_step(self, host: Host, job_id: str, timeout: float) -> str | None:
        """Block until a new step folder of the job appears in the NVMe tier (a step being
        written down); its name, or None after ``timeout``."""

    @abstractmethod
    def newest_slot(self, host: Host, job_id: str, rank: int) -> tuple[PurePath, int, int]:
        """The RAM-tier slot holding the rank's newest sealed shard: (path, step, bytes)."""

    @abstractmethod
    def file_size(self, host: Host, path: PurePath) -> int | None:
        """The size of a file on ``host``; None when there is no such file."""

    @abstractmethod
    def flip(self, host: Host, path: PurePath, start: int, nbytes: int) -> None:
        """Invert the byte in the middle of the ``nbytes`` at ``start`` of a file."""

    @abstractmethod
    def cut_link_for_good(self, host: Host) -> None:
        """The host's link down until the scenario is over."""
