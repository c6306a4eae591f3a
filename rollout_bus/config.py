"""Settings, one frozen object per process role, read from flags then ``ROLLOUT_BUS_*`` then defaults.

Only the CLI builds these; stages receive plain values. ``KafkaSettings.client_kwargs()`` turns
the connection settings (bootstrap servers, SASL/SSL) into keyword arguments that every Kafka
client in the project takes, so security settings pass through to all of them.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_bus.topics import Topics

ENV_PREFIX = "ROLLOUT_BUS_"


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")


class KafkaSettings(_Settings):
    """How to reach the cluster. Empty ``bootstrap_servers`` means: use the local broker."""

    bootstrap_servers: str = ""
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    topic_prefix: str = ""
    local_port: int = 9092

    def client_kwargs(self) -> dict[str, Any]:
        """Connection keyword arguments shared by kafka-python producers, consumers and admins."""
        kwargs: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers or f"127.0.0.1:{self.local_port}",
                                  "security_protocol": self.security_protocol}
        optional = {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": self.sasl_plain_username,
                    "ssl_cafile": self.ssl_cafile, "ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
        kwargs.update({k: v for k, v in optional.items() if v})
        if self.sasl_plain_password is not None:
            kwargs["sasl_plain_password"] = self.sasl_plain_password.get_secret_value()
        return kwargs

    def topics(self) -> Topics:
        return Topics(prefix=self.topic_prefix)


class GenerateSettings(_Settings):
    """The built-in generator (`rollout-bus generate`)."""

    episodes: int = 64
    seed: int = 0
    n_samples_per_prompt: int = 4
    adapters: str = ""
    max_turns: int = 3
    vocab_size: int = 32768
    min_response_len: int = 16
    max_response_len: int = 96
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 64
    compaction_prob: float = 0.15
    retry_prob: float = 0.1
    remove_prob: float = 0.05
    inject_faults: bool = False


class StreamSettings(_Settings):
    """The Faust stream worker (`rollout-bus stream`)."""

    app_id: str = "rollout-bus-stream"
    window_seconds: float = Field(60.0, gt=0)
    data_dir: str = ""


class ShardSettings(_Settings):
    """The shard writer (`rollout-bus shards`)."""

    out: str = "shards"
    dp_size: int = Field(2, ge=1)
    groups_per_batch: int = Field(2, ge=1)
    batching: str = "step"
    group_id: str = "rollout-bus-shards"
    normalization: str = "grpo"
