"""The live view's chart layout (display/chartlayout.py): panels, grid, colours, titles, ticks, labels.

Pure: a run state built by hand; the drawing itself is tested in test_display_chart.py.
"""

from __future__ import annotations

import pytest

from nbtrain.kernel.display import chartlayout
from nbtrain.livestate import LiveState
from nbtrain.messages import events


@pytest.mark.parametrize(
    ("values", "expected"),
    [([2.0, 0.5, 0.01], True), ([2.0, 0.5, 0.1], False), ([0.001, 0.5, 0.99], False), ([1.0, 0.0, 0.001], False)],
)
def test_log_scale_only_for_a_decaying_quantity_over_two_decades(values, expected):
    assert chartlayout.wants_log_scale(values) is expected


def test_panels_put_losses_first_cap_the_metrics_and_add_memory_and_throughput():
    state = LiveState(world_size=2, batch_size=8)
    names = ["lr", "accuracy", "loss", "grad_norm", "val_loss", "extra"]
    state.apply(
        events.Metrics(1, 0, ((1, 0.0, dict.fromkeys(names, 1.0)), (2, 0.5, dict.fromkeys(names, 0.5)))), now=1.0
    )
    state.apply(events.MemorySample(1, 1, 2**28), now=1.0)
    panels = chartlayout.chart_panels(state)
    assert [(p.kind, p.name) for p in panels] == [
        ("metric", "loss"),
        ("metric", "val_loss"),
        ("metric", "lr"),
        ("metric", "accuracy"),
        ("memory", "rss"),
        ("throughput", "samples/s"),
    ]
    assert chartlayout.grid_of(len(panels)) == (3, 2)
    assert chartlayout.chart_panels(LiveState()) == ()  # nothing logged: no chart
    assert chartlayout.grid_of(0) == (1, 1)


def test_titles_keep_the_value_and_shorten_the_name():
    title = chartlayout.fit_title("a_very_long_metric_name_that_cannot_fit", "12.5")
    assert len(title) == chartlayout.TITLE_CHARS and title.endswith("…  12.5")


def test_ranks_beyond_the_palette_reuse_its_colours():
    colours = chartlayout.RANK_COLOURS
    assert [chartlayout.rank_colour(r) for r in range(len(colours) + 1)] == [*colours, colours[0]]


def test_tick_labels_are_short_and_tell_neighbouring_ticks_apart():
    labels = chartlayout.tick_labels([0.0001, 0.0002, 0.0003])
    assert labels == ["1e-4", "2e-4", "3e-4"] and max(len(label) for label in labels) <= 6
    assert chartlayout.tick_labels([2_000_000.0, 2_500_000.0]) == ["2M", "2.5M"]


def test_value_labels_are_spread_apart_inside_the_axis():
    spread = chartlayout.spread_labels([50.0, 50.0, 50.0, 99.0], gap=5.0, low=0.0, high=100.0)
    assert spread == [45.0, 50.0, 55.0, 99.0]
    squeezed = chartlayout.spread_labels([1.0, 1.0], gap=5.0, low=0.0, high=100.0)
    assert squeezed == [0.0, 5.0]  # pushed up from the floor, not below it
