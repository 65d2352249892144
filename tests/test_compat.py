"""nbtrain.kernel.compat on the installed widget generation (.ci/test runs this file with
ipywidgets 8 in .venv and with Colab's ipywidgets 7.7 in .venv-colab)."""

from __future__ import annotations

import ipywidgets
import pytest

from nbtrain.kernel import compat

WIDGETS_MAJOR = int(ipywidgets.__version__.split(".")[0])


def test_a_widgets_bundle_refers_to_its_model_on_either_generation():
    button = ipywidgets.Button(description="Stop")
    try:
        bundle = compat.widget_bundle(button)
        view = {"version_major": 2, "version_minor": 0, "model_id": button.model_id}
        assert bundle[compat.WIDGET_VIEW_MIMETYPE] == view
        assert "Button" in bundle["text/plain"]
    finally:
        button.close()


def test_on_displayed_callbacks_run_after_nbtrain_shows_a_widget():
    button = ipywidgets.Button()
    seen = []
    if WIDGETS_MAJOR < 8:
        button.on_displayed(lambda widget: seen.append(widget))
    compat.widget_shown(button)
    assert seen == ([button] if WIDGETS_MAJOR < 8 else [])
    button.close()


def test_colab_needs_its_custom_widget_manager_only_for_ipywidgets_8():
    assert compat.needs_colab_widget_manager() == (WIDGETS_MAJOR >= 8)


@pytest.mark.parametrize(("mtime", "expected"), [(None, True), (1.0, False)])
def test_cells_in_linecache_are_told_from_files(mtime, expected):
    assert compat.only_in_memory("/tmp/x.py", (1, mtime, ["x\n"], "/tmp/x.py")) is expected
