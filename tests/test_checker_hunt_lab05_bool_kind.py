"""Lab 5's door rule against an answer that returns numpy's boolean.

The visible case "the answer is a bool" compared type *names*, and numpy 2 names its boolean scalar ``bool``:
``np.bool_(...)`` passed the notebook's checker, then failed the grader's ``isinstance(got, bool)`` -- a pass the
learner loses at grading.  Oracle: the exercise's ``-> bool`` and the hidden cases' own ``isinstance`` test."""

from __future__ import annotations

import numpy as np

from minivllm.labs import check_lab05
from tests.checker_verdicts import accepts, refuses


def _numpy_door(stats, max_waiting, min_free_blocks):
    waiting = np.int64(stats["num_waiting"])
    return np.bool_(waiting >= max_waiting or (waiting > 0 and stats["available_blocks"] < min_free_blocks))


def test_a_door_returning_numpy_bool_fails_the_visible_checker_as_it_fails_the_grader():
    assert not isinstance(_numpy_door(check_lab05._stats(waiting=4), 4, 16), bool)
    assert not check_lab05.hidden_should_reject(_numpy_door, 7)
    refuses(check_lab05.check_should_reject, _numpy_door, "the answer is a bool", "numpy")
    accepts(check_lab05.check_should_reject, check_lab05.engine_should_reject)
