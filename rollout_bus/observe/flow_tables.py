"""A run's flow as terminal tables (rich): who waited, and the last batches' sample age and discarded tokens.

Why: ``rollout-bus demo`` prints them at the end of a run, from what ``flow_fold.fold_flow`` folded of the
run's rollout.metrics records; the names are ``wire.flow_metrics``'.
"""

from __future__ import annotations

from rich.table import Table

from rollout_bus.observe.flow_fold import Flow
from rollout_bus.wire.flow_metrics import (DISCARD_CAUSES, RESPONSE_TOKENS, SAMPLE_AGE_KEYS, STAGE_TRAINER, WAIT_KEYS,
                                           discarded_token_fraction, discarded_tokens)

FLOW_BATCHES_SHOWN = 8


def _waiting_table(flow: Flow) -> Table:
    waiting = Table(title="flow: time spent waiting", show_lines=False)
    for column in ("stage", "source", "waited s", "fraction", "elapsed s", "waits/steps"):
        waiting.add_column(column, justify="left" if column in ("stage", "source") else "right")
    for row in flow.sources:
        m, stage = row["metrics"], row["stage"]
        waited, fraction, count = WAIT_KEYS.get(stage, WAIT_KEYS[STAGE_TRAINER])
        waiting.add_row(stage, row["source"], f"{m.get(waited, 0.0):.2f}", f"{m.get(fraction, 0.0):.3f}",
                        f"{row['elapsed_s'] or 0.0:.1f}", f"{m.get(count, 0.0):.0f}")
    return waiting


def _per_batch_table(flow: Flow) -> Table:
    shown = list(flow.batches.items())[-FLOW_BATCHES_SHOWN:]
    per_batch = Table(title=f"flow per batch (last {len(shown)} of {len(flow.batches)}): sample age in s (final "
                      "turn to batch written); response tokens discarded, by cause", show_lines=False)
    for column in ("batch", "age p50", "age p99", "age max", "tokens", *DISCARD_CAUSES):
        per_batch.add_column(column, justify="right", no_wrap=True)
    for seq, m in shown:
        ages = [f"{m[k]:.2f}" if k in m else "-" for k in SAMPLE_AGE_KEYS]
        causes = [f"{m.get(discarded_tokens(c), 0.0):.0f} {m.get(discarded_token_fraction(c), 0.0):.1%}"
                  for c in DISCARD_CAUSES]
        per_batch.add_row(str(seq), *ages, f"{m.get(RESPONSE_TOKENS, 0.0):.0f}", *causes)
    return per_batch


def flow_tables(flow: Flow) -> list[Table]:
    """Who waited (each generator behind the staleness gate, the trainer for batches) and each batch's sample
    age and discarded tokens by cause, as the run's rollout.metrics records say."""
    return ([_waiting_table(flow)] if flow.sources else []) + ([_per_batch_table(flow)] if flow.batches else [])
