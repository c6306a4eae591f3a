"""``make demo``'s flow tables: who waited, and the last batches' sample age and discarded tokens."""

from __future__ import annotations

from rollout_bus.wire.flow_metrics import generator_flow, trainer_flow
from rollout_bus.observe.flow_fold import Flow
from rollout_bus.observe.flow_tables import FLOW_BATCHES_SHOWN, flow_tables


def test_one_row_per_source_and_only_the_last_batches():
    flow = Flow({seq: {"flow/sample_age_s/p50": 0.5, "flow/response_tokens": 100.0,
                       "flow/discarded_tokens/removed": 10.0, "flow/discarded_token_fraction/removed": 0.1}
                 for seq in range(FLOW_BATCHES_SHOWN + 2)},
                [{"stage": "generator", "source": "g0of1-seed0", "elapsed_s": 10.0, "final": True,
                  "metrics": generator_flow(2.0, 3, 10.0)},
                 {"stage": "trainer", "source": "trainer", "elapsed_s": 10.0, "final": True,
                  "metrics": trainer_flow(6.0, 4, 10.0)}])
    waiting, per_batch = flow_tables(flow)
    assert waiting.row_count == 2 and [c._cells for c in waiting.columns][2] == ["2.00", "6.00"]
    assert [c._cells for c in waiting.columns][5] == ["3", "4"]  # the generator's waits, the trainer's steps
    assert per_batch.row_count == FLOW_BATCHES_SHOWN
    assert f"last {FLOW_BATCHES_SHOWN} of {FLOW_BATCHES_SHOWN + 2}" in str(per_batch.title)
    assert per_batch.columns[0]._cells[0] == "2" and per_batch.columns[6]._cells[0] == "10 10.0%"


def test_no_flow_record_no_table():
    assert flow_tables(Flow()) == []
