"""Every record header the bus defines, beside the records that read and write them (WIRE.md sections 4.2, 4.6, 5.1, 5.2 and 7.2).

A header name, its values and its parsing start here: ``TurnHeaders`` for the six headers of a turn on
rollout.turns, the ``takeover_tokens`` header of an episode record, the ``control`` header that tells a control
record (end of run, abandoned, batch skipped) from data, and the header the stream worker adds to a re-routed
turn. The dead letter's ``dlq.*`` headers are beside ``DeadLetter`` in ``dead_letter.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rollout_bus.errors import ContractError

# Record headers on rollout.turns (WIRE.md section 4.2); values are ASCII decimal strings.
HEADER_TURN = "turn"
HEADER_ATTEMPT = "attempt"
HEADER_FINAL = "final"
HEADER_GROUP_SIZE = "group_size"
HEADER_SCHEMA = "schema"
HEADER_SENT_AT = "sent_at"
# Optional: which generator made the turn, stable across its restarts (WIRE.md section 4.2); the stream worker
# refuses a turn whose episode another generator already holds (dlq.kind ``collision``).
HEADER_GENERATOR = "generator"
# Optional: the delivery of the prompt group the turn was made for (1, 2, ...: its ``claimed`` events on
# rollout.prompt_ledger; WIRE.md section 4.2). A higher delivery takes an episode over from a generator that died;
# a lower one is a zombie's late turn, fenced. Absent (0) for a generator that plans its own groups.
HEADER_DELIVERY = "delivery"
# Optional, ``1`` on the first turn a delivery publishes for an episode it resumes (WIRE.md section 4.2): the
# turns below it are the ones the log already holds (an earlier delivery's, kept), not made again. Only with
# ``delivery`` and a turn above 0.
HEADER_RESUMED = "resumed"
# Optional, on a rollout.episodes data record: the response tokens that generator takeovers threw away for the
# episode (the stored turns of the lower deliveries' attempts, discarded when a higher delivery made it again;
# WIRE.md section 5.1), ASCII decimal >= 1; absent when none. The shard writer's batch flow counts them (cause
# ``takeover``).
HEADER_TAKEOVER_TOKENS = "takeover_tokens"
GENERATOR_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
SCHEMA_VERSION = "1"
# Set by the stream worker on a turn it moved to its key's partition (``topic:partition:offset`` it came from).
HEADER_REROUTED_FROM = "rerouted-from"
# A control record (end of run, abandoned episode) carries this header; data records never do.
HEADER_CONTROL = "control"
# Its values.
CONTROL_END_OF_RUN = "end-of-run"
CONTROL_ABANDONED = "abandoned"
CONTROL_BATCH_SKIPPED = "batch-skipped"


def control_kind(headers: Iterable[tuple[str, bytes]] | None) -> str | None:
    """The ``control`` header's value (``end-of-run``, ``abandoned``, ``batch-skipped``), or None for a data record."""
    for name, value in headers or ():
        if name == HEADER_CONTROL:
            return bytes(value or b"").decode("ascii", "replace")
    return None


@dataclass(frozen=True)
class TurnHeaders:
    """The headers of a rollout.turns record (WIRE.md section 4.2)."""

    turn: int
    attempt: int
    final: bool
    group_size: int
    sent_at_ms: int
    schema: str = SCHEMA_VERSION
    generator: str | None = None
    delivery: int = 0
    resumed: bool = False

    def to_kafka(self) -> list[tuple[str, bytes]]:
        headers = [(HEADER_TURN, str(self.turn).encode()), (HEADER_ATTEMPT, str(self.attempt).encode()),
                   (HEADER_FINAL, b"1" if self.final else b"0"), (HEADER_GROUP_SIZE, str(self.group_size).encode()),
                   (HEADER_SCHEMA, self.schema.encode()), (HEADER_SENT_AT, str(self.sent_at_ms).encode())]
        if self.generator is not None:
            headers.append((HEADER_GENERATOR, check_generator_id(self.generator).encode()))
        if self.delivery:
            headers.append((HEADER_DELIVERY, str(self.delivery).encode()))
        if self.resumed:
            headers.append((HEADER_RESUMED, b"1"))
        return headers

    @classmethod
    def from_kafka(cls, headers: Iterable[tuple[str, bytes]] | None) -> "TurnHeaders":
        """Parse and check the headers; ContractError names the header that is missing or wrong."""
        found = {k: v for k, v in (headers or [])}

        def integer(name: str, minimum: int) -> int:
            raw = found.get(name)
            if raw is None:
                raise ContractError(f"header {name!r} is missing")
            text = bytes(raw)
            if not (text.isdigit() or (text[:1] == b"-" and text[1:].isdigit())):  # ASCII digits only (WIRE.md)
                raise ContractError(f"header {name!r} must be a decimal integer in ASCII digits (got {text!r})")
            value = int(text)
            if value < minimum:
                raise ContractError(f"header {name!r} must be >= {minimum} (got {value})")
            return value

        schema = bytes(found.get(HEADER_SCHEMA, b"")).decode("ascii", "replace")
        if schema != SCHEMA_VERSION:
            raise ContractError(f"header {HEADER_SCHEMA!r} must be {SCHEMA_VERSION!r} (got {schema!r})")
        final = integer(HEADER_FINAL, 0)
        if final not in (0, 1):
            raise ContractError(f"header {HEADER_FINAL!r} must be 0 or 1 (got {final})")
        generator = found.get(HEADER_GENERATOR)
        if generator is not None:
            generator = check_generator_id(bytes(generator).decode("ascii", "replace"))
        turn = integer(HEADER_TURN, 0)
        delivery = integer(HEADER_DELIVERY, 1) if HEADER_DELIVERY in found else 0
        resumed = found.get(HEADER_RESUMED)
        if resumed is not None:
            if bytes(resumed) != b"1":
                raise ContractError(f"header {HEADER_RESUMED!r} must be 1 when present (got {bytes(resumed)!r})")
            if not delivery or turn == 0:
                raise ContractError(f"header {HEADER_RESUMED!r} needs a {HEADER_DELIVERY!r} header and a turn above 0 "
                                    f"(got delivery {delivery}, turn {turn})")
        return cls(turn=turn, attempt=integer(HEADER_ATTEMPT, 0), final=bool(final),
                   group_size=integer(HEADER_GROUP_SIZE, 1), sent_at_ms=integer(HEADER_SENT_AT, 0), schema=schema,
                   generator=generator, delivery=delivery, resumed=resumed is not None)


def check_generator_id(generator: str) -> str:
    """``generator`` unchanged, or ContractError: 1-128 of ASCII letters, digits and ``._:/-``."""
    if not GENERATOR_ID.fullmatch(generator):
        raise ContractError(f"header {HEADER_GENERATOR!r} must be 1-128 of ASCII letters, digits and '._:/-' "
                            f"(got {generator!r})")
    return generator
