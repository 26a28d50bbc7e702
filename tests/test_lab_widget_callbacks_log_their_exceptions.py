"""A widget control whose callback raises logs the error under the picture instead of raising.

The promise is :class:`~minivllm.labs.widgets.PictureWidget`'s: "an exception in a callback is written to the
widget's log instead of vanishing into the kernel log".  An ipywidgets observer that raises only reaches the
kernel's log, so a learner who moves a slider to a setting whose simulation fails sees nothing happen.  The
oracle is that promise: after the failing input, the log holds the exception's line, nothing propagated, and
the next input still works (the lock was released).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minivllm.labs import widgets  # noqa: E402

w = pytest.importorskip("ipywidgets")


def _simulate(budget, threshold):
    if budget == 128:
        raise ValueError("no run at budget 128")
    return {"step_log": [], "prompt_lens": {}, "itls": [], "title": "", "summary": f"budget {budget}"}


def _shown(explorer):
    """The widget's image and log as :meth:`show` builds them, without a notebook to display them in."""
    explorer.image = w.Image(value=explorer.png(), format="png")
    explorer.log = w.HTML()
    return explorer.controls(w)[0].children[0]  # the max_num_batched_tokens slider


def test_a_slider_whose_simulation_raises_logs_the_error_and_the_next_move_still_works():
    explorer = widgets.BudgetExplorer(_simulate)
    slider = _shown(explorer)
    slider.value = 128  # would raise out of the observer (into the kernel log) before the fix
    assert explorer._lines[-1] == "sliders: ValueError: no run at budget 128"
    assert "no run at budget 128" in explorer.log.value
    slider.value = 256
    assert explorer._lines[-1] == "budget 256"
    assert explorer.values == (256, 0)


def test_a_button_whose_redraw_raises_logs_the_error():
    """The redraw after a click runs the widget's own drawing: a failure there is the callback's too."""

    class Engine:
        def __init__(self):
            self.steps = 0

        def has_unfinished_requests(self):
            return True

        def step(self):
            self.steps += 1

    def draw(engine, ax):
        if engine.steps == 2:
            raise RuntimeError("cannot draw step 2")

    stepper = widgets.Stepper(Engine(), draw=draw, describe=lambda e: f"ran step {e.steps}")
    stepper.image = w.Image(value=stepper.png(), format="png")
    assert stepper.press("next step") == "ran step 1"
    assert stepper.press("next step") == "next step: RuntimeError: cannot draw step 2"
    assert stepper._lines[-2:] == ["ran step 2", "next step: RuntimeError: cannot draw step 2"]
    assert stepper.press("next step") == "ran step 3"


def test_live_loads_run_again_click_that_raises_says_so_under_the_picture():
    """:class:`~minivllm.labs.live.LiveLoad` is no PictureWidget, and its "run again" button called ``run``
    straight from the click: the exception reached only the kernel's log, and the line under the picture kept
    the previous run's numbers as if the click had worked.  Oracle: the exception's own text, raised by hand
    from the second engine the widget builds (the first click's); the next click runs again."""
    import io
    from contextlib import redirect_stdout

    from minivllm.labs import check_lab08
    from minivllm.labs.live import LiveLoad, ramp_arrivals

    built = []

    def make_engine():
        built.append(1)
        if len(built) == 2:
            raise RuntimeError("no engine for the second run")
        return check_lab08.lab_engine()

    live = LiveLoad(make_engine, ramp_arrivals([4], 1.0, seed=0), every_s=0.5, figsize=(4, 1))
    with redirect_stdout(io.StringIO()):
        live.show()  # the first run, as a notebook cell shows it
    assert "served" in live._label.value
    (button,) = [c for c in live.widget.children if getattr(c, "description", None) == "run again"]
    button.click()  # what ipywidgets does with a click in the browser
    assert live._label.value == "run again: RuntimeError: no engine for the second run"
    button.click()
    assert "served" in live._label.value and len(built) == 3
