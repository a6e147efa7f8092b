"""TLS settings: both files or neither, readable, a real certificate and key; a CA only
where it is used. Every bad value is a ConfigError naming the field and the file."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest

import agentd.config
import supervisor.config
from phalanx.certs import Authority, make_authority
from phalanx.settings import ConfigError


@pytest.fixture(autouse=True)
def hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("PHALANX_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(agentd.config, "DEFAULT_CONFIG", tmp_path / "absent-agentd.toml")
    monkeypatch.setattr(supervisor.config, "DEFAULT_CONFIG", tmp_path / "absent-sup.toml")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("pki"))


def agent(*flags: str) -> agentd.config.AgentSettings:
    return agentd.config.load(list(flags))


def sup(*flags: str) -> supervisor.config.SupervisorSettings:
    return supervisor.config.load(list(flags))


def test_an_agent_with_a_certificate_and_key_serves_https_and_verifies_peers(
    ca: Authority,
) -> None:
    files = ca.issue("n01")

    http = agent(
        "--http.tls-cert-file",
        str(files.cert),
        "--http.tls-key-file",
        str(files.key),
        "--http.tls-ca-file",
        str(ca.ca),
    ).http

    assert isinstance(http.server_ssl(), ssl.SSLContext)
    peer = http.peer_ssl()
    assert peer is not None
    assert (peer.verify_mode, peer.check_hostname) == (ssl.CERT_REQUIRED, True)


def test_an_agent_without_tls_files_serves_and_speaks_plain_http() -> None:
    http = agent().http

    assert (http.server_ssl(), http.peer_ssl()) == (None, None)


def test_a_certificate_without_its_key_is_refused_naming_both_fields(ca: Authority) -> None:
    files = ca.issue("n01")

    with pytest.raises(ConfigError, match=r"http: .*tls_cert_file is set but tls_key_file is not"):
        agent("--http.tls-cert-file", str(files.cert))


def test_a_key_without_its_certificate_is_refused_naming_both_fields(ca: Authority) -> None:
    files = ca.issue("sup")

    with pytest.raises(ConfigError, match=r"api: .*tls_key_file is set but tls_cert_file is not"):
        sup("--api.tls-key-file", str(files.key))


def test_a_missing_certificate_file_is_refused_naming_the_field_and_the_file(
    ca: Authority, tmp_path: Path
) -> None:
    files = ca.issue("sup")
    absent = tmp_path / "nowhere.pem"

    with pytest.raises(ConfigError) as err:
        sup("--api.tls-cert-file", str(absent), "--api.tls-key-file", str(files.key))

    assert f"api.tls_cert_file: Value error, cannot read {absent}" in str(err.value)


def test_a_key_that_is_not_the_certificates_is_refused_naming_both_files(
    ca: Authority,
) -> None:
    one, other = ca.issue("n01"), ca.issue("n02")

    with pytest.raises(ConfigError) as err:
        agent("--http.tls-cert-file", str(one.cert), "--http.tls-key-file", str(other.key))

    assert f"{one.cert} and {other.key} are not a PEM certificate and its private key" in str(
        err.value
    )


def test_a_file_that_is_not_pem_is_refused_naming_it(ca: Authority, tmp_path: Path) -> None:
    files = ca.issue("n01")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")

    with pytest.raises(ConfigError, match=f"{junk} and {files.key} are not a PEM certificate"):
        agent("--http.tls-cert-file", str(junk), "--http.tls-key-file", str(files.key))


def test_a_ca_file_that_holds_no_certificate_is_refused_naming_it(
    ca: Authority, tmp_path: Path
) -> None:
    files = ca.issue("n01")
    empty = tmp_path / "empty.pem"
    empty.write_text("")

    with pytest.raises(ConfigError) as err:
        agent(
            "--http.tls-cert-file",
            str(files.cert),
            "--http.tls-key-file",
            str(files.key),
            "--http.tls-ca-file",
            str(empty),
        )

    assert f"http.tls_ca_file: Value error, {empty} is not a PEM bundle of CA certificates" in (
        str(err.value)
    )


def test_an_agent_ca_without_tls_of_its_own_is_refused(ca: Authority) -> None:
    with pytest.raises(ConfigError, match="tls_ca_file is set but this agent serves plain HTTP"):
        agent("--http.tls-ca-file", str(ca.ca))


def test_the_supervisor_reaches_agents_over_https_with_agent_tls(ca: Authority) -> None:
    settings = sup("--agent-tls", "--agent-ca-file", str(ca.ca))

    context = settings.agent_ssl()
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert sup().agent_ssl() is None


def test_an_agent_ca_file_without_agent_tls_is_refused(ca: Authority) -> None:
    with pytest.raises(ConfigError, match="agent_ca_file is set but agent_tls is not"):
        sup("--agent-ca-file", str(ca.ca))


def test_the_api_serves_https_with_files_from_the_config_file(
    ca: Authority, tmp_path: Path
) -> None:
    files = ca.issue("sup")
    conf = tmp_path / "supervisor.toml"
    conf.write_text(f'[api]\ntls_cert_file = "{files.cert}"\ntls_key_file = "{files.key}"\n')

    assert isinstance(sup("--config", str(conf)).api.server_ssl(), ssl.SSLContext)
