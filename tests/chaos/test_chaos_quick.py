"""The quick chaos table (``python -m tests.chaos --quick``) as one test: every row must pass.

It runs on a broker of its own (a free port of ``free_ports``, killed and restarted by one scenario),
never the suite's shared broker, and takes about two to three minutes.
"""

from __future__ import annotations

import pytest

from tests.chaos.runner import format_failures, format_table, run_table
from tests.chaos.scenarios import QUICK


@pytest.mark.timeout(900)
def test_quick_chaos_table_passes_every_row(tmp_path):
    rows = run_table(QUICK, tmp_path, echo=lambda _m: None)
    table = format_table(rows)
    print(table)
    assert [r.scenario for r in rows] == ["baseline-small", *(s.name for s in QUICK)]
    assert all(r.passed for r in rows), f"\n{table}\n\n{format_failures(rows)}"
