"""Settings shared by both daemons and the one loader they use.

Precedence, highest first (written down here once):

1. command-line flags (``--mqtt.port 1884``, kebab-case field names);
2. environment variables (``PHALANX_AGENTD_MQTT__PORT=1884``: the daemon's
   prefix, nested fields joined by ``__``);
3. the TOML file (``--config PATH``, or the daemon's ``..._CONFIG`` variable,
   or its default path; a missing default file is fine, a missing named file
   is an error);
4. the defaults documented on each field.

Unknown keys are rejected at every level: in the file, in flags and in
environment variables under the daemon's prefix. A bad value raises
:class:`ConfigError`, whose message names the field; the entry points turn it
into exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsError,
)

from phalanx.tls import check_readable, check_server_pair, server_context


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field or file."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerTls(_Section):
    """The two fields with which an HTTP server serves HTTPS: both or neither."""

    tls_cert_file: Path | None = Field(
        default=None,
        description="PEM certificate (chain) to serve HTTPS with, together with "
        "`tls_key_file`. Its subject alternative names must cover the name or address "
        "clients dial (an agent's advertised `address`: an IP SAN does). Unset: plain HTTP.",
    )
    tls_key_file: Path | None = Field(
        default=None, description="The private key of `tls_cert_file` (PEM, unencrypted)."
    )

    @field_validator("tls_cert_file", "tls_key_file")
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        return None if path is None else check_readable(path)

    @model_validator(mode="after")
    def _pair(self) -> ServerTls:
        cert, key = self.tls_cert_file, self.tls_key_file
        if (cert is None) != (key is None):
            given, missing = ("tls_cert_file", "tls_key_file")[:: 1 if key is None else -1]
            raise ValueError(f"{given} is set but {missing} is not: HTTPS needs both")
        if cert is not None and key is not None:
            try:
                check_server_pair(cert, key)
            except ValueError as exc:
                raise ValueError(f"tls_cert_file, tls_key_file: {exc}") from exc
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def server_ssl(self) -> ssl.SSLContext | None:
        """The context to serve with; ``None``: plain HTTP."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return server_context(self.tls_cert_file, self.tls_key_file)


class MqttSettings(_Section):
    host: str = Field(default="127.0.0.1", description="MQTT broker host name or address.")
    port: int = Field(default=1883, ge=1, le=65535, description="MQTT broker port.")
    username: str | None = Field(default=None, description="Broker user (one per node).")
    password: SecretStr | None = Field(default=None, description="Broker password.")
    password_file: Path | None = Field(
        default=None, description="File holding the broker password (preferred over `password`)."
    )
    tls: bool = Field(default=False, description="Connect with TLS.")
    ca_file: Path | None = Field(default=None, description="CA bundle that signed the broker.")
    cert_file: Path | None = Field(default=None, description="Client certificate (mutual TLS).")
    key_file: Path | None = Field(default=None, description="Client key (mutual TLS).")
    keepalive_s: int = Field(
        default=10,
        ge=2,
        le=600,
        description="MQTT keepalive. The broker fires the last will after 1.5x this without "
        "traffic, so it bounds how long a dead agent stays 'up'.",
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of one connect.")
    reconnect_initial_s: float = Field(default=0.2, gt=0, description="First reconnect delay.")
    reconnect_max_s: float = Field(default=10.0, gt=0, description="Reconnect delay cap.")
    max_inflight: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="QoS 1 messages this client sends before the broker acknowledges any; 0: "
        "no limit. Past a limit, paho scans every message in flight at each acknowledgement "
        "for one to send next: at 16,384, 2,048 publishes at once were acknowledged in 0.40 "
        "s, not 0.21 s, and 4,096 in 1.45 s, not 0.62 s (bench/publish_burst.py).",
    )

    brokers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Several brokers, `HOST:PORT` each (`HOST` alone: `port`; `[ADDR]:PORT` "
        "for IPv6), in place of `host` and `port`. An agent uses one at a time and moves to "
        "the next when its broker is lost; the supervisor connects to all of them at once, "
        "so that it hears every node wherever it is. Empty: `host`:`port` alone.",
    )

    @field_validator("brokers", mode="before")
    @classmethod
    def _split_brokers(cls, value: object) -> object:
        # An environment variable or a flag gives them comma-separated (or as JSON).
        if isinstance(value, str):
            if value.lstrip().startswith('["'):
                try:
                    return json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"not a JSON list of brokers: {exc}") from exc
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _one_way_to_name_brokers(self) -> MqttSettings:
        given = {"host", "port"} & self.model_fields_set
        if self.brokers and "host" in given:
            raise ValueError(
                "give the broker either as mqtt.host (and mqtt.port) or as mqtt.brokers, not both"
            )
        seen: set[tuple[str, int]] = set()
        for entry in self.brokers:
            endpoint = _endpoint(entry, self.port)
            if endpoint in seen:
                raise ValueError(f"mqtt.brokers lists {entry!r} twice")
            seen.add(endpoint)
        return self

    def endpoints(self) -> list[tuple[str, int]]:
        """The brokers to use, in order: ``brokers``, or ``host``:``port`` alone."""
        if not self.brokers:
            return [(self.host, self.port)]
        return [_endpoint(entry, self.port) for entry in self.brokers]

    def resolved(self) -> MqttSettings:
        """Read ``password_file`` into ``password``."""
        if self.password_file is None:
            return self
        try:
            secret = self.password_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"mqtt.password_file: cannot read {self.password_file}: {exc}"
            ) from exc
        return self.model_copy(update={"password": SecretStr(secret)})


def _endpoint(entry: str, default_port: int) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[ADDR]:PORT`` as ``(host, port)``; a ValueError names
    the entry."""
    text = entry.strip()
    host, port = text, str(default_port)
    if text.startswith("["):
        addr, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"mqtt.brokers entry {entry!r} is not [ADDRESS]:PORT")
        host, port = addr, rest[1:] or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    elif ":" in text:
        raise ValueError(f"mqtt.brokers entry {entry!r}: write an IPv6 address as [ADDRESS]:PORT")
    if not host or any(c.isspace() or c in "/@" for c in host):
        raise ValueError(f"mqtt.brokers entry {entry!r} has no valid host")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"mqtt.brokers entry {entry!r} has no valid port (1-65535)")
    return host, int(port)


S = TypeVar("S", bound=BaseSettings)


def load_settings(
    cls: type[S],
    argv: Sequence[str],
    *,
    prog: str,
    env_prefix: str,
    default_config: Path,
) -> S:
    """Build ``cls`` from CLI flags, the environment and a TOML file (see module doc)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, rest = pre.parse_known_args(list(argv))
    named = known.config or (
        Path(os.environ[f"{env_prefix}CONFIG"]) if os.environ.get(f"{env_prefix}CONFIG") else None
    )
    path = named or default_config
    file_values: dict[str, Any] = {}
    if path.exists():
        try:
            with path.open("rb") as fh:
                file_values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
    elif named is not None:
        raise ConfigError(f"config file {path} does not exist")
    _reject_unknown_env(cls, env_prefix)
    source = (
        f"config file {path}, environment or flags"
        if path.exists()
        else f"environment or flags; no config file at {path}"
    )

    class _Loaded(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            cli: CliSettingsSource[Any] = CliSettingsSource(
                settings_cls,
                cli_parse_args=rest,
                cli_prog_name=prog,
                cli_kebab_case=True,
                cli_exit_on_error=False,
                cli_implicit_flags=True,
            )
            return (cli, env_settings, InitSettingsSource(settings_cls, file_values))

    _Loaded.__name__ = cls.__name__
    _Loaded.model_config = {
        **cls.model_config,
        "env_prefix": env_prefix,
        "env_nested_delimiter": "__",
        "extra": "forbid",
    }
    try:
        loaded = _Loaded()
    except ValidationError as exc:
        raise ConfigError(describe_validation(exc, source=source)) from exc
    except SettingsError as exc:  # unknown or malformed flags
        raise ConfigError(f"invalid command line: {exc}") from exc
    return loaded


def _reject_unknown_env(cls: type[BaseSettings], prefix: str) -> None:
    """A variable under the daemon's prefix that names no field is a typo: say so."""
    known = {name.upper() for name in cls.model_fields} | {"CONFIG"}
    unknown = sorted(
        key
        for key in os.environ
        if key.upper().startswith(prefix) and key.upper()[len(prefix) :].split("__")[0] not in known
    )
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}: no such "
            f"setting (known: {', '.join(sorted(known))})"
        )


def describe_validation(exc: ValidationError, *, source: str = "") -> str:
    """One line per bad field: ``field.path: what is wrong (got VALUE)``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        got = err.get("input")
        secret = any(word in loc for word in ("password", "token", "secret"))
        shown = "" if isinstance(got, dict) or got is None or secret else f" (got {got!r})"
        lines.append(f"{loc}: {err['msg']}{shown}")
    where = f" ({source})" if source else ""
    return f"invalid configuration{where}:\n  " + "\n  ".join(lines)
