"""Support code for the minivllm lab course (``solutions/`` and ``labs/`` notebooks).

Why a package and not notebook cells?  Checkers, widgets and quizzes are the
same for every learner and every lab, they need tests of their own, and a
notebook should show the lesson, not plumbing.  Each lab imports from here:

* :mod:`minivllm.labs.checkers` -- the checker framework (named cases, first
  failure shown with expected vs got and a hint) and :func:`choose`, which
  picks the learner's code when its checker passed and the engine's otherwise;
* :mod:`minivllm.labs.check_lab01` .. ``check_labNN`` -- one checker per exercise, and at the end
  of each module the lab's registration ``LAB`` (:mod:`minivllm.labs.registry`: exercises, points,
  planted bugs, hidden cases, quiz), which the tests and the grader discover;
* :mod:`minivllm.labs.grade` -- the autograder behind ``minivllm grade``;
* :mod:`minivllm.labs.widgets` -- block pool view, radix tree view, step
  timeline, and a step-through control; all degrade to static pictures;
* :mod:`minivllm.labs.quiz` -- the end-of-lab retrieval quiz (data in
  ``quizzes/labNN.json``);
* :mod:`minivllm.labs.workloads` -- seeded workloads and small replay loops
  shared by the labs, the figures script and the tests.
"""

from minivllm.labs.checkers import Case, CheckResult, choose, run_checks

__all__ = ["Case", "CheckResult", "choose", "run_checks"]
