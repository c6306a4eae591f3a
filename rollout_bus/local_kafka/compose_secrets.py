"""The secrets a secured compose stack mounts (compose/docker-compose.secure.yml), made on the host first.

Why: the committed compose files must hold no secret, and a container must see only its own. The same CA,
broker certificate and principals as ``kafka start --secure`` (``secure.SecureSetup``, here with the host
names the containers and the host dial), plus the files the override hands out one by one as compose
secrets: no password reaches a compose file, an environment variable or a command line.

Contract: ``ComposeSecrets(directory).prepare(java, hosts)`` makes what is missing and writes, beside the
``SecureSetup`` material (``ca.pem``, the broker keystore, ``users/NAME.password``):

* ``kafka-secrets.properties``: the broker's keystore password, mounted as the Kafka image's file input
  (``/mnt/shared/config/server.properties``), the only secret in the broker's configuration;
* ``kafka-tls.properties``: Kafka's own tools inside the Kafka container as the broker certificate (mutual
  TLS on the ``BROKER`` listener, a super user): the healthcheck and the one-shot that creates the SCRAM
  principals before anything else starts (KRaft takes new principals only from a running cluster or a
  format, and the official image's entry point formats without them);
* ``scram/NAME.properties``: ``SCRAM-SHA-512=password=...``, ``kafka-configs --add-config-file``'s spelling.

The directory is its owner's only (0700); the files in it are readable by any user (0644) because a
container's user (uid 10001 for rollout-bus, 1000 for Kafka) is not the host's, and compose mounts each
secret file by itself, so only the services that list a secret see it. ``SECRETS_IN_CONTAINERS`` is where
they appear inside.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout_bus.local_kafka.certificates import write_private
from rollout_bus.local_kafka.secure import MECHANISM, SecureSetup

SECRETS_IN_CONTAINERS = Path("/run/secrets")  # compose's mount point of a service's secrets
COMPOSE_HOSTS = ("kafka", "kafka-2", "kafka-3", "localhost", "127.0.0.1")


@dataclass(frozen=True)
class ComposeSecrets:
    """The secured compose stack's secrets in one directory (see the module docstring)."""

    directory: Path

    @property
    def setup(self) -> SecureSetup:
        return SecureSetup(self.directory)

    @property
    def kafka_secrets(self) -> Path:
        return self.directory / "kafka-secrets.properties"

    @property
    def kafka_tls(self) -> Path:
        return self.directory / "kafka-tls.properties"

    def scram_file(self, user: str) -> Path:
        return self.directory / "scram" / f"{user}.properties"

    def prepare(self, java: str, hosts: Sequence[str] = COMPOSE_HOSTS) -> list[Path]:
        """Make the material (where missing) and every file the override mounts; return the files written."""
        setup = self.setup
        setup.prepare(java, hosts)
        keystore_password = setup.keystore().password()
        inside = SECRETS_IN_CONTAINERS
        (self.directory / "scram").mkdir(mode=0o700, exist_ok=True)
        written = {
            self.kafka_secrets: f"ssl.keystore.password={keystore_password}\n",
            self.kafka_tls: "".join(f"{k}={v}\n" for k, v in {
                "security.protocol": "SSL", "ssl.keystore.type": "PKCS12",
                "ssl.keystore.location": str(inside / "broker_keystore"), "ssl.keystore.password": keystore_password,
                "ssl.truststore.type": "PEM", "ssl.truststore.location": str(inside / "ca_pem")}.items()),
            **{self.scram_file(user): f"{MECHANISM}=password={setup.password(user)}\n" for user in setup.users()},
        }
        for path, text in written.items():
            write_private(path, text)
        readable = [*written, setup.ca_file, setup.keystore().store, *(setup.password_file(u) for u in setup.users())]
        for path in readable:
            os.chmod(path, 0o644)
        os.chmod(self.directory, 0o700)
        return sorted(readable)
