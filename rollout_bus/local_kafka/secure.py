"""What makes the local broker a secured one: TLS, SCRAM principals, an authorizer that refuses by default.

Why: the bus carries a run's data and, on rollout.weights, tells every generator which weights to load; a
client that reaches the port must prove who it is, over TLS, and may do only what its role needs.

The secured node listens for clients on ``SASL_SSL`` (TLS, then SCRAM-SHA-512 credentials); its controller
listener is TLS with a client certificate required (KRaft cannot check SCRAM there: the credentials live in
the metadata the controller serves), and the node itself presents the broker certificate, whose principal
``User:CN=rollout-bus-broker`` is a super user, as is ``User:admin``, the SCRAM principal that sets ACLs and
that brokers use between themselves. ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``:
a principal with no ACL is refused everything.

Contract: ``SecureSetup(directory)`` keeps, in ``directory`` (owner-only files): the CA (``ca.pem`` is what a
client trusts), the broker keystore, one password file per principal (``users/NAME.password``: ``admin`` and
one per role in ``ROLES``), and ``NAME.env`` per principal, the ``ROLLOUT_BUS_*`` settings a client of that
principal needs (the password by file, never in the environment). ``prepare(java, hosts)`` makes what is
missing; ``server_settings(...)`` are the node's listener, TLS, SASL and authorizer settings;
``scram_format_args()`` are the ``kafka-storage format`` arguments that create every principal's credentials
(handed to the JVM in an argument file, so no password is on a command line); ``open_to_roles(bootstrap,
conn)``, once the node answers, writes every principal's client files and grants each role its ACLs.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.kafka.acls import ROLES, grant_roles
from rollout_bus.local_kafka.certificates import (Authority, Keystore, keytool_beside, make_authority, make_keystore,
                                                write_private)
from rollout_bus.wire.topics import Topics

MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"
BROKER_CN = "rollout-bus-broker"
CA_NAME = "ca"
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def jaas(username: str, password: str) -> str:
    """A SCRAM login line for Kafka's ``sasl.jaas.config``."""
    return f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{username}" password="{password}";'


@dataclass(frozen=True)
class SecureSetup:
    """The secured node's material in one directory (see the module docstring)."""

    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / f"{CA_NAME}.pem"

    def password_file(self, user: str) -> Path:
        return self.directory / "users" / f"{user}.password"

    def env_file(self, user: str) -> Path:
        return self.directory / f"{user}.env"

    @property
    def tools_properties(self) -> Path:
        """Kafka's own tools as ``admin`` (``--command-config``)."""
        return self.directory / "admin.properties"

    def users(self) -> tuple[str, ...]:
        return (ADMIN, *ROLES)

    def password(self, user: str) -> str:
        return self.password_file(user).read_text().strip()

    def prepare(self, java: str, hosts: Sequence[str] = DEFAULT_HOSTS) -> None:
        """Make the CA, the broker keystore and every principal's password, where missing."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        keytool = keytool_beside(java)
        authority = make_authority(self.directory, CA_NAME, keytool)
        make_keystore(self.directory, authority, BROKER_CN, hosts, keytool)
        (self.directory / "users").mkdir(mode=0o700, exist_ok=True)
        for user in self.users():
            if not self.password_file(user).exists():
                write_private(self.password_file(user), secrets.token_urlsafe(24))

    def authority(self) -> Authority:
        store = self.directory / f"{CA_NAME}.p12"
        return Authority(store, store.with_suffix(".password"), self.ca_file)

    def keystore(self) -> Keystore:
        store = self.directory / f"{BROKER_CN}.p12"
        return Keystore(store, store.with_suffix(".password"))

    def server_settings(self, port: int, controller_port: int, host: str = "127.0.0.1") -> dict[str, str]:
        """Listeners, TLS, SCRAM and the authorizer for a node on ``host`` (replacing the plaintext ones)."""
        keystore = self.keystore()
        return {
            "listeners": f"SASL_SSL://{host}:{port},CONTROLLER://{host}:{controller_port}",
            "advertised.listeners": f"SASL_SSL://{host}:{port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas(ADMIN, self.password(ADMIN)),
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(keystore.store),
            "ssl.keystore.password": keystore.password(),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca_file),
            "listener.name.controller.ssl.client.auth": "required",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{ADMIN};User:CN={BROKER_CN}",
        }

    def scram_format_args(self) -> list[str]:
        """``kafka-storage format`` arguments creating every principal's SCRAM credentials."""
        args = []
        for user in self.users():
            args += ["--add-scram", f"{MECHANISM}=[name={user},password={self.password(user)}]"]
        return args

    def write_client_files(self, bootstrap: str) -> None:
        """``NAME.env`` for every principal and ``admin.properties`` for Kafka's tools."""
        for user in self.users():
            write_private(self.env_file(user), "".join(f"{k}={v}\n" for k, v in self.client_env(user, bootstrap).items()))
        write_private(self.tools_properties, "".join(f"{k}={v}\n" for k, v in {
            "security.protocol": "SASL_SSL", "sasl.mechanism": MECHANISM,
            "sasl.jaas.config": jaas(ADMIN, self.password(ADMIN)),
            "ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.ca_file)}.items()))

    def open_to_roles(self, bootstrap: str, conn: Mapping[str, Any]) -> None:
        """Every principal's client files, and each role's ACLs on the unprefixed topics (``conn``: as admin)."""
        self.write_client_files(bootstrap)
        grant_roles(conn, Topics())

    def client_env(self, user: str, bootstrap: str) -> dict[str, str]:
        """The ``ROLLOUT_BUS_*`` settings of a client that is ``user`` (its password by file)."""
        return {"ROLLOUT_BUS_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_BUS_SECURITY_PROTOCOL": "SASL_SSL",
                "ROLLOUT_BUS_SASL_MECHANISM": MECHANISM, "ROLLOUT_BUS_SASL_PLAIN_USERNAME": user,
                "ROLLOUT_BUS_SASL_PASSWORD_FILE": str(self.password_file(user)),
                "ROLLOUT_BUS_SSL_CAFILE": str(self.ca_file)}

    def client_kwargs(self, user: str, bootstrap: str) -> dict[str, str]:
        """kafka-python connection keywords of a client that is ``user``."""
        return {"bootstrap_servers": bootstrap, "security_protocol": "SASL_SSL", "sasl_mechanism": MECHANISM,
                "sasl_plain_username": user, "sasl_plain_password": self.password(user),
                "ssl_cafile": str(self.ca_file)}
