"""A bug hunt on the calibration fit (``minivllm.sim.calibrate``), with the roofline itself as the oracle: a
known :class:`HardwareSpec` makes the step times of the calibration grid's batch shapes, and the fit must give
that spec back -- or refuse the data with a ValueError that says why.  No real engine is measured."""

from dataclasses import asdict

import numpy as np
import pytest

from minivllm.sim.presets import model_preset
from minivllm.sim.roofline import HardwareSpec, roofline_time, step_cost

SHAPE = model_preset("smollm2-135m").with_dtype(4)
TRUTH = HardwareSpec("truth", peak_flops=60e9, mem_bandwidth=12e9, attention_flops=25e9, attention_bandwidth=3e9,
                     step_overhead_s=4e-3, seq_overhead_s=0.3e-3, eager_step_overhead_s=6e-3, swap_bandwidth=2e9)


def _grid():
    """Batch shapes like the calibration grid's (lone prefills, a chunked one, mixed steps, decode batches at
    short and long context): both regimes of both phases, prompt steps and decode-only steps."""
    out = [[(0, n, True)] for n in (16, 64, 160, 320, 512)] + [[(512, 512, True)], [(0, 64, True)] * 4]
    for b, ctx in ((1, 40), (2, 40), (4, 40), (8, 40), (16, 40), (32, 40), (1, 400), (4, 400), (12, 400),
                   (1, 1024), (4, 1024)):
        out.append([(ctx, 1, True)] * b)
    out.append([(300, 1, True)] * 6 + [(0, 200, False)])
    return out


def test_a_refit_of_steps_that_moved_blocks_gives_back_the_spec_that_made_them():
    """``roofline_time`` charges a step's swapped blocks at ``swap_bandwidth``, so the stored predictions of a
    profile include it; the fit must take that known time off the measured one before solving for the other
    terms.  It did not: on this grid, with every fifth step also swapping 40 blocks (2.6 ms at 2 GB/s), the
    swap time was smeared over the other terms, a 2.9% rms error on exact data, and the headline
    ``rms_rel_error`` disagreed with the profile's own ``pred_s`` (computed without the swap time they include)."""
    from minivllm.sim.calibrate import refit

    block_size = 16
    batches = _grid()
    swapped = [40 if i % 5 == 0 else 0 for i in range(len(batches))]
    costs = [step_cost(SHAPE, b, s, block_size) for b, s in zip(batches, swapped)]
    times = [roofline_time(c, SHAPE, TRUTH).total for c in costs]
    assert max(c.swap_bytes / TRUTH.swap_bandwidth / t for c, t in zip(costs, times)) > 0.01  # visible in the data
    doc = {"device": "cpu", "model": asdict(SHAPE), "engine": {"block_size": block_size},
           "fit": {"measured_read_bandwidth": TRUTH.mem_bandwidth},
           "hardware": {"name": "toy", "swap_bandwidth": TRUTH.swap_bandwidth},
           "samples": [{"seqs": [list(x) for x in b], "swapped_blocks": s, "time_s": t}
                       for b, s, t in zip(batches, swapped, times)]}
    refit(doc)
    got = HardwareSpec.from_dict(doc["hardware"])
    assert doc["fit"]["rms_rel_error"] < 1e-6
    for k in ("peak_flops", "attention_flops", "attention_bandwidth", "step_overhead_s", "seq_overhead_s",
              "eager_step_overhead_s", "swap_bandwidth"):
        assert getattr(got, k) == pytest.approx(getattr(TRUTH, k), rel=1e-6), k
    assert [s["pred_s"] for s in doc["samples"]] == pytest.approx(times, rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -0.01])
def test_a_step_time_that_is_not_a_positive_number_is_refused_with_a_value_error(bad):
    """A measured step time must be finite and > 0.  An infinite one (``Infinity`` is valid JSON to Python, so
    a hand-edited profile handed to ``--refit`` can carry it) slipped past the ``> 0`` check, turned the relative
    weights into NaN and failed deep in the fit: ``TypeError: cannot unpack non-iterable NoneType`` on one grid
    (a traceback, since the CLI reports ValueErrors only), numpy's "zero-size array to reduction operation" on
    this one."""
    from minivllm.sim.calibrate import fit

    costs = [step_cost(SHAPE, b) for b in _grid()]
    times = [roofline_time(c, SHAPE, TRUTH).total for c in costs]
    times[3] = bad
    with pytest.raises(ValueError, match="step times"):
        fit(costs, times)


def test_a_grid_that_never_reaches_the_compute_roof_leaves_it_unidentified():
    """On a device where every step of the grid is memory bound (the H200 with a 1B model), the data say
    nothing about the compute roofs; the fit must leave them "infinite" (``spec_from_theta``'s 1e30), which is
    what ``profile_spec`` looks for (``>= 1e29``) to complete a GPU profile from its datasheet.  Kills: any finite
    stand-in (``spec_from_theta`` with ``inf = 1e28``), and a fit without its all-memory-bound starting guess,
    which keeps a compute-bound solution the data cannot tell apart: as exact on the grid, and an 8K prefill
    wildly fast."""
    from minivllm.sim.calibrate import fit, spec_from_theta
    from minivllm.sim.presets import _UNIDENTIFIED

    memory_bound = HardwareSpec("mem", peak_flops=1e16, mem_bandwidth=12e9, attention_flops=1e16,
                                attention_bandwidth=3e9, step_overhead_s=4e-3, seq_overhead_s=0.3e-3)
    costs = [step_cost(SHAPE, b) for b in _grid()]
    assert all(roofline_time(c, SHAPE, memory_bound).dense_bound == "memory" for c in costs)
    times = [roofline_time(c, SHAPE, memory_bound).total for c in costs]
    for pinned in (1 / memory_bound.mem_bandwidth, None):
        theta, err = fit(costs, times, s_per_byte=pinned)
        got = spec_from_theta(theta, "fit")
        assert err < 1e-6
        assert got.peak_flops >= _UNIDENTIFIED and got.attention_flops >= _UNIDENTIFIED, pinned
        assert got.mem_bandwidth == pytest.approx(memory_bound.mem_bandwidth, rel=1e-6)


def test_the_same_steps_measured_twice_fit_the_same_spec():
    """Duplicating every sample (a grid measured twice, or ``--repeats`` without the median) must not move the
    fit: relative least squares with the same residuals twice has the same minimum.  With noise, so the answer
    is not simply the exact one.  Kills: the returned rms error summing the squared errors instead of averaging."""
    from minivllm.sim.calibrate import fit

    costs = [step_cost(SHAPE, b) for b in _grid()]
    rng = np.random.default_rng(3)
    times = [roofline_time(c, SHAPE, TRUTH).total * (1 + 0.03 * rng.standard_normal()) for c in costs]
    once, err1 = fit(costs, times)
    twice, err2 = fit(costs * 2, times * 2)
    assert twice == pytest.approx(once, rel=1e-6) and err2 == pytest.approx(err1, rel=1e-9)
