"""The flow metrics of one written batch: how old its episodes were when it was written, and how much of
what was generated for it is thrown away, by cause.

Why: a run can be healthy by every count and still waste its fleet: samples that wait long before they
train are off-policy, and tokens that never train are compute spent for nothing. Only the writer sees a
batch's whole fate (what it writes, what its staleness net drops, which samples are removed).

Contract: ``batch_flow(decision, now_ms)`` returns keys without the ``rollout/`` prefix (``metrics_records.prefixed``
adds it), all floats; the names are ``rollout_bus.wire.flow_metrics``' (their one home):

* ``flow/sample_age_s/{p50,p99,max}``: per written episode, ``now_ms`` minus its final turn's ``sent_at``
  (the episode record's header: the generator's clock when it sent that turn), in seconds; numpy's
  linear percentiles. Absent when no written episode has a ``sent_at`` above 0.
* ``flow/response_tokens``: the response tokens generated for every episode the batch decided on, written and
  stale, with those that generator takeovers threw away while making them (their ``takeover_tokens`` headers):
  those were generated for this batch's episodes and never train, like a stale episode's, so they count among
  what was generated (and a batch's ``takeover`` fraction is of every token its episodes cost).
* ``flow/incomplete_groups``: the groups the batch holds short (the end-of-run flush: the run ended without
  their missing members; the manifest says ``complete: false``), so ``tail`` shows them beside the dead letters.
* ``flow/discarded_tokens/{aborted,removed,stale,takeover}`` and ``flow/discarded_token_fraction/{...}`` (over
  ``flow/response_tokens``), plus the unscoped ``flow/discarded_token_fraction``, their sum: a stale
  episode's tokens (dropped by the staleness net, dead-lettered as ``stale``), a removed sample's
  (``remove_sample``) counted ``aborted`` when its status is ABORTED, else ``removed``, and the ``takeover``
  tokens: the sum of the ``takeover_tokens`` headers of the written and stale episodes (the stored turns of a
  dead generator's delivery the stream worker discarded when a higher delivery made the episode again; an
  episode whose remaking never finished sends no record, and its discarded tokens are counted by no batch).
  Fractions are absent when the batch has no response token.

They are live observations: the rollout.metrics batch record carries them, the manifest does not (a
replay writes it again byte for byte), and a batch found on disk at start-up and announced late has none.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from rollout_bus.model.sample import Sample, Status
from rollout_bus.consumers.shard_writer.decide import Decision
from rollout_bus.consumers.shard_writer.episodes import Episode
from rollout_bus.wire.flow_metrics import (CAUSE_ABORTED, CAUSE_REMOVED, CAUSE_STALE, CAUSE_TAKEOVER, DISCARD_CAUSES,
                                           INCOMPLETE_GROUPS, RESPONSE_TOKENS, SAMPLE_AGE_MAX, SAMPLE_AGE_P50,
                                           SAMPLE_AGE_P99, discarded_token_fraction, discarded_tokens)
from rollout_bus.wire.headers import HEADER_SENT_AT, HEADER_TAKEOVER_TOKENS


def _header_count(episode: Episode, name: str) -> int:
    """The episode record's header ``name`` as a non-negative integer (0 when absent or not one)."""
    for header, value in episode.headers:
        if header == name:
            try:
                return max(0, int(bytes(value).decode("ascii")))
            except (UnicodeDecodeError, ValueError):
                return 0
    return 0


def episode_sent_at_ms(episode: Episode) -> int:
    """The episode's final turn ``sent_at`` (ms since the epoch; 0 when the record has none)."""
    return _header_count(episode, HEADER_SENT_AT)


def episode_takeover_tokens(episode: Episode) -> int:
    """The response tokens generator takeovers threw away making the episode (0 when the record says none)."""
    return _header_count(episode, HEADER_TAKEOVER_TOKENS)


def _tokens(samples: Iterable[Sample]) -> int:
    return sum(int(s.response_length) for s in samples)


def batch_flow(decision: Decision, now_ms: int) -> dict[str, float]:
    """The batch's flow metrics (see the module docstring)."""
    batch = decision.batch
    found: dict[str, float] = {}
    ages = [(now_ms - sent) / 1000.0 for sent in map(episode_sent_at_ms, batch.episodes) if sent > 0]
    if ages:
        p50, p99 = np.percentile(np.asarray(ages, dtype=np.float64), [50, 99])
        found |= {SAMPLE_AGE_P50: float(p50), SAMPLE_AGE_P99: float(p99), SAMPLE_AGE_MAX: float(max(ages))}
    written = batch.samples()
    discarded = {
        CAUSE_ABORTED: _tokens(s for s in written if s.remove_sample and s.status is Status.ABORTED),
        CAUSE_REMOVED: _tokens(s for s in written if s.remove_sample and s.status is not Status.ABORTED),
        CAUSE_STALE: _tokens(segment for stale in batch.stale for segment in stale.episode.segments),
        CAUSE_TAKEOVER: sum(map(episode_takeover_tokens, [*batch.episodes, *(s.episode for s in batch.stale)])),
    }
    total = _tokens(written) + discarded[CAUSE_STALE] + discarded[CAUSE_TAKEOVER]
    found[RESPONSE_TOKENS] = float(total)
    found[INCOMPLETE_GROUPS] = float(sum(not group.complete for group in batch.groups))
    for cause in DISCARD_CAUSES:
        found[discarded_tokens(cause)] = float(discarded[cause])
        if total:
            found[discarded_token_fraction(cause)] = discarded[cause] / total
    if total:
        found[discarded_token_fraction()] = sum(discarded.values()) / total
    return found
