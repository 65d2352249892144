"""The live view's chart layout (display/chartlayout.py): panels, grid, colours, titles, ticks, labels.

Pure: a run state built by hand; the drawing itself is tested in test_display_chart.py.
"""

from __future__ import annotations

import pytest

from nbtrain.kernel.display import chartlayout


@pytest.mark.parametrize(
    ("values", "expected"),
    [([2.0, 0.5, 0.01], True), ([2.0, 0.5, 0.1], False), ([0.001, 0.5, 0.99], False), ([1.0, 0.0, 0.001], False)],
)
def test_log_scale_only_for_a_decaying_quantity_over_two_decades(values, expected):
    assert chartlayout.wants_log_scale(values) is expected
