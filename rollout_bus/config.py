"""Settings, one frozen object per process role, read from flags then ``ROLLOUT_BUS_*`` then defaults.

Only the CLI builds these; stages receive plain values. ``KafkaSettings.client_kwargs()`` turns
the connection settings (bootstrap servers, SASL/SSL) into keyword arguments that every Kafka
client in the project takes, so security settings pass through to all of them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_bus.errors import ConfigError
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, MAX_RECORD_BYTES_CEILING, Topics, check_prefix

ENV_PREFIX = "ROLLOUT_BUS_"


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")


def _read_secret(path: str, setting: str) -> str:
    """The first line of the file ``path`` names; ``ConfigError`` says which setting and why not."""
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{setting}={path!r} cannot be read: {exc.strerror or exc}") from exc


class KafkaSettings(_Settings):
    """How to reach the cluster. Empty ``bootstrap_servers`` means: use the local broker."""

    bootstrap_servers: str = ""
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    # the password in a file (owner-only), so it is in no process's environment (``ps e``) either
    sasl_password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    topic_prefix: str = ""
    local_port: int = 9092
    # the largest record value on any topic (rollout_bus.kafka.limits sizes topics, producers, consumers)
    max_record_bytes: int = Field(DEFAULT_MAX_RECORD_BYTES, ge=1 << 20, le=MAX_RECORD_BYTES_CEILING)

    @field_validator("topic_prefix")
    @classmethod
    def _legal_prefix(cls, prefix: str) -> str:
        return check_prefix(prefix)

    def client_kwargs(self) -> dict[str, Any]:
        """Connection keyword arguments shared by kafka-python producers, consumers and admins."""
        kwargs: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers or f"127.0.0.1:{self.local_port}",
                                  "security_protocol": self.security_protocol}
        optional = {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": self.sasl_plain_username,
                    "ssl_cafile": self.ssl_cafile, "ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
        kwargs.update({k: v for k, v in optional.items() if v})
        if self.sasl_plain_password is not None:
            kwargs["sasl_plain_password"] = self.sasl_plain_password.get_secret_value()
        elif self.sasl_password_file:
            kwargs["sasl_plain_password"] = _read_secret(self.sasl_password_file, "ROLLOUT_BUS_SASL_PASSWORD_FILE")
        return kwargs

    def topics(self) -> Topics:
        return Topics(prefix=self.topic_prefix)


class BatchingSettings(_Settings):
    """What batch k is, for every stage of a run: one object, one default, one declaration on the bus.

    ``batching="step"``: batch k holds the prompt groups with group_index in ``[k*G, (k+1)*G)``,
    G = ``groups_per_batch``, and trains at trainer step k; ``"arrival"``: the first G groups to
    complete (no replay identity). ``max_staleness`` K is the run's staleness bound (step batching):
    the generator starts a group of batch k only once the live weight version is >= k - K, and the
    shard writer drops an episode older than that as ``stale``; None: no bound.

    The generator (when it holds to a bound) and the shard writer both declare these on rollout.run
    before they start (``rollout_bus.kafka.run_record``): the first declaration is the run's, and a
    stage whose settings differ is refused, naming the setting, so two stages never disagree on
    what batch k is. ``generate``, ``shards``, ``demo`` and ``replay`` take them from the same flags.
    """

    groups_per_batch: int = 4
    batching: str = "step"  # "step" or "arrival"
    max_staleness: int | None = None

    @model_validator(mode="after")
    def _a_run_batching(self) -> "BatchingSettings":
        self.run_batching()  # the one check of these settings is the value's (a ConfigError is a ValueError)
        return self

    def run_batching(self, declared_by: str = "") -> RunBatching:
        """These settings as the value a stage is handed, and (``declared_by``: who) declares on rollout.run."""
        return RunBatching(self.groups_per_batch, self.batching, self.max_staleness, declared_by)


class GenerateSettings(BatchingSettings):
    """The built-in generator (`rollout-bus generate`). Every knob is seeded by ``seed``.

    ``episodes`` are split into ``ceil(episodes / n_samples_per_prompt)`` prompt groups (the last
    one may be smaller), assigned to the comma-separated ``adapters`` round-robin. Probabilities
    are per episode (``retry_prob`` per attempt, ``compaction_prob`` per turn boundary,
    ``tool_call_prob`` per turn). ``top_k <= 0`` means no top-k limit.

    ``run_id`` names the run (empty: a fresh uuid hex per run). With ``end_of_run`` the generator
    closes the run once everything is acknowledged (an end-of-run record on every rollout.turns
    partition: the shard writer then writes the last, partial batch). Several generators sharing
    one run set ``end_of_run`` off and one ``run_id``; then one of them, or the operator
    (``rollout-bus end-run --run-id``), closes the run once all are done.
    ``delivery_timeout_s``: how long a record may wait inside the producer for the broker (an
    outage) before the run fails; meanwhile it logs a WARNING every 10 s.
    """

    episodes: int = Field(64, ge=1)
    seed: int = Field(0, ge=0)
    n_samples_per_prompt: int = Field(4, ge=1)
    adapters: str = ""
    max_turns: int = Field(3, ge=1)
    vocab_size: int = Field(32768, ge=64, le=2**31 - 1)
    min_response_len: int = Field(16, ge=1)
    max_response_len: int = Field(96, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = 64
    min_p: float = Field(0.0, ge=0, lt=1)  # SGLang's min-p, after top-k and top-p (0: none)
    compaction_prob: float = Field(0.15, ge=0, le=1)
    retry_prob: float = Field(0.1, ge=0, le=1)
    max_attempts: int = Field(3, ge=1)
    remove_prob: float = Field(0.05, ge=0, le=1)
    tool_call_prob: float = Field(0.3, ge=0, le=1)
    truncation_prob: float = Field(0.1, ge=0, le=1)
    policy_version: int = Field(0, ge=0)
    policy_dim: int = Field(32, ge=1)
    torch_threads: int = Field(1, ge=0)
    inject_faults: bool = False
    run_id: str = ""
    end_of_run: bool = True
    delivery_timeout_s: float = Field(900.0, ge=31)  # kafka-python: >= request timeout (30 s) + linger
    # the control loop (rollout.weights): stamp turns with the trainer's live version; with max_staleness
    # (BatchingSettings), admit a group of batch k only once that version is >= k - max_staleness
    follow_weights: bool = False
    # share of turns interrupted when the live version changes mid-turn (an aborted partial turn, then
    # its continuation under the new version)
    interrupt_prob: float = Field(0.0, ge=0, le=1)
    # who samples: "sim", the seeded stand-in with every knob above; "policy", the real policy
    # (rollout_bus.learn: calculator episodes, the trainer's weights; the episode-shape knobs do not apply)
    # "http" (with ``from_prompts``): a real engine, SGLang's native /generate at ``engine_url`` with
    # return_sampling_mask; ``engine_timeout_s`` per call
    engine: Literal["sim", "policy", "http"] = "sim"
    engine_url: str = ""  # one URL, or several comma-separated: a pool (``producers.engine_pool``)
    engine_timeout_s: float = Field(120.0, gt=0)
    # the prompt-fed generator's plug-ins (rollout_bus.producers.plugins), "module:attr": ``env_factory`` makes
    # multi-turn episodes (--engine http), ``reward_fn`` scores finished ones (a dict answer: its ``reward_key``)
    env_factory: str = ""
    reward_fn: str = ""
    reward_key: str = Field("reward", min_length=1)
    # the policy engine following the trainer: how long after a published version's checkpoint is refused
    # (missing, or failing its sha256) it waits, with no verified weights, for a newer one before it exits
    # (rollout_bus.errors.EXIT_NO_USABLE_WEIGHTS); 0: for ever. A generator with verified weights goes on.
    weights_wait_s: float = Field(120.0, ge=0)
    # several generators on one run: generator ``generator_index`` of ``generators`` takes the run's group
    # indices g with g mod generators == generator_index (its j-th group is j * generators + generator_index),
    # so no two generators make the same group, and step batch k still holds the run's groups [k*G, (k+1)*G)
    generators: int = Field(1, ge=1)
    generator_index: int = Field(0, ge=0)
    # one member of the elastic group taking prompt groups from rollout.prompts (``rollout-bus prompts load``)
    # instead of planning its own: ``concurrency`` prompt groups in flight at once, each delivered at most
    # ``max_deliveries`` times before it is failed; ``turn_latency_ms``: the sim engine's time per engine call
    from_prompts: bool = False
    concurrency: int = Field(4, ge=1, le=256)
    max_deliveries: int = Field(3, ge=1)
    turn_latency_ms: float = Field(0.0, ge=0)
    # a delivery above 1 continues each episode from the turns the log holds (WIRE.md section 15.3); False: makes
    # and sends every turn again (what a taken-over prompt group cost before resuming: a bench's baseline)
    resume: bool = True
    member_id: str = ""  # the member's ``generator`` header (default: host and pid, one per process)

    @model_validator(mode="after")
    def _generator_in_range(self) -> "GenerateSettings":
        if self.generator_index >= self.generators:
            raise ValueError(f"generator_index must be < generators={self.generators} (got {self.generator_index})")
        if self.engine == "http" and not self.from_prompts:
            raise ValueError("engine 'http' makes episodes from prompt groups: give --from-prompts")
        return self

    def group_plan(self) -> dict[str, Any]:
        """How this generator numbers its prompt groups: the arguments of ``rollout_bus.producers.groups.plan_groups``
        (a stage takes plain values, never these settings)."""
        return {"episodes": self.episodes, "n_samples_per_prompt": self.n_samples_per_prompt, "adapters": self.adapters,
                "generators": self.generators, "generator_index": self.generator_index}

    def generator_id(self) -> str:
        """The ``generator`` header of its turns (WIRE.md 4.2): the same for a restart of this generator (same
        place among the run's generators, same seed), another for any generator that would make other episodes."""
        if self.from_prompts:  # a member of the group: one per process, whatever prompt groups it takes
            return self.member_id or f"m-{socket.gethostname()[:64]}-{os.getpid()}"
        return f"g{self.generator_index}of{self.generators}-seed{self.seed}"


class PromptLoadSettings(_Settings):
    """Loading a user's prompt file (`rollout-bus prompts load FILE`): which fields hold the prompt and the label
    (as miles' --input-key/--label-key), the local tokenizer directory that turns text and chat messages into
    token ids, and what a line without its own ``n_samples`` or ``adapter`` gets."""

    prompt_key: str = Field("prompt", min_length=1)
    label_key: str = Field("label", min_length=1)
    tokenizer: Path | None = None
    n_samples: int = Field(4, ge=1)  # as generate's n_samples_per_prompt
    adapter: str | None = Field(None, min_length=1)


class StreamSettings(_Settings):
    """The Faust stream worker (`rollout-bus stream`).

    ``app_id`` is the consumer group and names the state changelog topic (workers sharing the
    work share it); a window closes once its partition's event time passes end + grace.
    """

    app_id: str = "rollout-bus-stream"
    window_seconds: float = Field(60.0, gt=0)
    window_grace_seconds: float = Field(10.0, ge=0)
    data_dir: str = ""
    stats_interval_seconds: float = Field(30.0, gt=0)
    commit_interval_seconds: float = Field(1.0, gt=0)
    replication_factor: int = Field(1, ge=1)


DEFAULT_DP_SIZE = 2  # data-parallel ranks: the shard writer writes one shard per rank, a trainer reads as many


class ShardSettings(BatchingSettings):
    """The shard writer (`rollout-bus shards`); its batching is ``BatchingSettings``.

    Batch boundaries follow from the log alone (complete groups, abandoned records, end-of-run
    markers), never from a clock. ``exit_on_end_of_run`` stops the writer once the end-of-run
    flush is written and committed; ``exit_when_idle`` once no record arrived for a while and it
    is caught up (a stop condition only: it never writes a batch); ``max_batches`` after that many
    batches written by this process. ``written_memory``: how many recent batches' rollout keys stay
    in memory (older ones are read back from their manifests when needed).
    """

    out: str = "shards"
    dp_size: int = Field(DEFAULT_DP_SIZE, ge=1)
    group_id: str = "rollout-bus-shards"
    normalization: Literal["none", "grpo", "grpo_std"] = "grpo"
    exit_when_idle: bool = False
    exit_on_end_of_run: bool = False
    max_batches: int | None = Field(None, ge=1)
    written_memory: int = Field(64, ge=1)
