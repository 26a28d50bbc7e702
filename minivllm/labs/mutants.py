"""Compatibility view: the planted bugs now live in each lab's registration.

Every ``Exercise`` in a ``check_labNN.LAB`` carries its own ``mutants``
(``(description, old, new)`` text patches on the solution region, applied with
:func:`minivllm.labs.registry.apply_mutant`); ``tests/test_labs.py`` requires
each one to fail its checker.  ``MUTANTS`` rebuilds the old
``{exercise name: [mutants]}`` table from the registry, anew at each use (nothing is cached: the
registry stays the one copy).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "MUTANTS":
        from minivllm.labs.registry import labs

        return {ex.name: list(ex.mutants) for lab in labs() for ex in lab.exercises}
    raise AttributeError(name)
