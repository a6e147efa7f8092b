#!/usr/bin/python
"""Ansible module: a Mosquitto password file that holds exactly the given users.

``mosquitto_passwd`` salts every hash at random, so running it on every
converge would rewrite the file (and reload the broker) each time. This
module keeps a user's line as it is when its hash still matches the wanted
password, and hashes new or changed passwords the way Mosquitto 2 does
(``$7$``: PBKDF2-HMAC-SHA512, random 12-byte salt). Users not given are
removed. The file changes only when a user, a password or a mode changes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import tempfile
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: mosquitto_passwd
short_description: Manage a Mosquitto password file idempotently
description:
  - Writes a Mosquitto 2 password file holding exactly O(users).
  - A line is kept when its hash verifies against the wanted password, so
    repeated runs report no change.
options:
  path:
    description: The password file.
    type: path
    required: true
  users:
    description: User name to password.
    type: dict
    required: true
  iterations:
    description: PBKDF2 iterations for new hashes (Mosquitto's default is 101).
    type: int
    default: 101
extends_documentation_fragment:
  - ansible.builtin.files
author: Phalanx
"""

EXAMPLES = r"""
- name: Broker users
  mosquitto_passwd:
    path: /etc/mosquitto/phalanx/passwd
    users: {gpu-a17: "{{ vault_gpu_a17_password }}"}
    mode: "0640"
"""

RETURN = r"""
users:
  description: The users in the file, sorted.
  type: list
  returned: always
"""

SALT_BYTES = 12


def hash_password(password: str, iterations: int) -> str:
    salt = secrets.token_bytes(SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verifies(stored: str, password: str) -> bool:
    """True when ``stored`` (a ``$7$`` hash) is the hash of ``password``."""
    parts = stored.split("$")
    if len(parts) != 5 or parts[1] != "7":
        return False
    try:
        iterations = int(parts[2])
        salt = base64.b64decode(parts[3], validate=True)
        digest = base64.b64decode(parts[4], validate=True)
    except ValueError:
        return False
    computed = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return hmac.compare_digest(computed, digest)


def read_entries(path: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                user, sep, stored = line.rstrip("\n").partition(":")
                if sep and user:
                    entries[user] = stored
    except FileNotFoundError:
        pass
    return entries


def render(users: dict[str, str], existing: dict[str, str], iterations: int) -> str:
    lines = []
    for user in sorted(users):
        stored = existing.get(user, "")
        if not verifies(stored, users[user]):
            stored = hash_password(users[user], iterations)
        lines.append(f"{user}:{stored}\n")
    return "".join(lines)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "users": {"type": "dict", "required": True, "no_log": True},
            "iterations": {"type": "int", "default": 101},
        },
        add_file_common_args=True,
        supports_check_mode=True,
    )
    path: str = module.params["path"]
    users: dict[str, Any] = module.params["users"]
    bad = sorted(u for u in users if not u or ":" in u or "\n" in u)
    if bad:
        module.fail_json(msg=f"user names must be non-empty without ':' or newlines: {bad}")
    wanted = {str(u): str(p) for u, p in users.items()}
    empty = sorted(u for u, p in wanted.items() if not p)
    if empty:
        module.fail_json(msg=f"users without a password: {empty}")

    existing = read_entries(path)
    content = render(wanted, existing, module.params["iterations"])
    try:
        with open(path, encoding="utf-8") as fh:
            current = fh.read()
    except FileNotFoundError:
        current = None
    changed = content != current
    if changed and not module.check_mode:
        directory = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".passwd.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o600)
            # A new file lands with the default mode for a moment: the directory
            # (0750, root:mosquitto) keeps others out; the mode is set just below.
            module.atomic_move(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    file_args = module.load_file_common_arguments(module.params)
    if not module.check_mode or os.path.exists(path):
        changed = module.set_fs_attributes_if_different(file_args, changed)
    module.exit_json(changed=changed, path=path, users=sorted(wanted))


if __name__ == "__main__":
    main()
