"""The checker framework: small named cases, in order, stop at the first failure.

Why this shape?  A learner who gets "AssertionError" from a 40-line test learns
nothing.  A checker here runs cases from the simplest (empty input, one block)
to the subtle (exact block boundary, sharing, eviction), and at the first one
that fails prints *which* case, what was expected, what came back, and a hint
aimed at the mistake that usually causes that failure.

A ``NotImplementedError`` (the stub in a student notebook) prints
"not implemented yet" instead of a traceback, so student notebooks run top to
bottom in CI and a stuck learner can still run the rest of a lab: later cells
call :func:`choose` and fall back to the engine's own implementation.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

_MISSING = object()


@dataclass
class Case:
    """One check: ``run(candidate)`` returns what the candidate produced.

    ``expected`` is compared with ``==`` unless ``accept`` is given, in which
    case ``accept(got)`` decides (for answers with more than one right form).
    ``hint`` is shown only when this case fails: write it for the usual mistake.
    ``diagnose(got)``, when given, reads the wrong answer's symptom and returns
    a hint for the mistake that produces it (or ``None`` to fall back to
    ``hint``): one case catches several bugs, and a hint written for the bug
    the case was built for misleads the learner who made another.
    ``diagnose_raise(candidate, exc)`` does the same for a case whose run
    raised: it may re-run the candidate on inputs of its own to find which
    mistake the raise came from, and returns ``None`` (``hint`` then) when it
    cannot tell -- a raise has no symptom to read, so telling two mistakes
    apart takes an experiment.
    """

    name: str
    run: Callable[[Any], Any]
    expected: Any = None
    hint: str = ""
    accept: Callable[[Any], bool] | None = None
    show_expected: str | None = None  # text to print instead of repr(expected)
    diagnose: Callable[[Any], str | None] | None = None
    diagnose_raise: Callable[[Any, Exception], str | None] | None = None

    def passes(self, got: Any) -> bool:
        if self.accept is not None:
            return bool(self.accept(got))
        return got == self.expected


@dataclass
class CheckResult:
    """Truthy when every case passed; keeps what happened for tests and :func:`choose`."""

    title: str
    passed: bool
    num_cases: int
    num_passed: int
    failed_case: str | None = None
    not_implemented: bool = False
    lines: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:  # keeps notebook outputs short and stable
        state = "passed" if self.passed else ("not implemented yet" if self.not_implemented else "failed")
        return f"<{self.title}: {state}, {self.num_passed}/{self.num_cases} cases>"


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dict_difference(got: Any, expected: Any, limit: int = 300) -> str | None:
    """For two dicts too long to print whole: the keys whose values differ (missing and extra keys too).

    ``_short`` cuts a long repr at ``limit`` characters, which can cut off exactly the field that is wrong
    (a metrics dict of a dozen keys); this line names it.  ``None`` when the dicts print whole or agree.
    """
    if not (isinstance(got, dict) and isinstance(expected, dict)):
        return None
    if len(repr(got)) <= limit and len(repr(expected)) <= limit:
        return None
    parts = []
    for key in expected:
        if key not in got:
            parts.append(f"{key!r} missing")
        elif not _same_values(got[key], expected[key]):
            parts.append(f"{key!r}: expected {_short(expected[key], 60)}, got {_short(got[key], 60)}")
    parts += [f"{key!r} not expected" for key in got if key not in expected]
    return "; ".join(parts) or None


def _container_difference(got: Any, expected: Any, where: str = "") -> str | None:
    """Where ``got`` has ``expected``'s values but a list where a tuple belongs (or the other way round).

    The rule, the same in every checker, visible and hidden: the container type in an exercise's signature is
    part of its contract (``-> list[int]`` is a list; ``-> tuple[float, float]`` a tuple), so an answer of the
    right values in the wrong container fails -- with this plain hint, not the hint for a wrong value.
    ``None`` when the values differ too, or nothing differs.
    """
    seq = (list, tuple)
    if isinstance(got, seq) and isinstance(expected, seq):
        # every value first, at every depth: an inner container that is wrong beside a sibling value that is
        # wrong too must not be reported as "right values"
        if not _same_values(got, expected):
            return None
        if type(got) is not type(expected):
            want, have = type(expected).__name__, type(got).__name__
            return (f"right values, but return a {want}, not a {have}" if not where
                    else f"right values, but {where} must be a {want}, not a {have}")
        for i, (g, e) in enumerate(zip(got, expected)):
            if (found := _container_difference(g, e, f"item {i}" if not where else f"{where}, item {i}")) is not None:
                return found
    return None


def wrong_container(got: Any, kind: type, where: str) -> str | None:
    """A hidden case's verdict on the container rule above: ``"<where>: returned a tuple, not a list"``, or None."""
    return None if isinstance(got, kind) else f"{where}: returned a {type(got).__name__}, not a {kind.__name__}"


def _same_values(got: Any, expected: Any) -> bool:
    """``got == expected`` with lists and tuples read alike, at any depth."""
    seq = (list, tuple)
    if isinstance(got, seq) and isinstance(expected, seq):
        return len(got) == len(expected) and all(_same_values(g, e) for g, e in zip(got, expected))
    return bool(got == expected)


def run_checks(title: str, candidate: Any, cases: Sequence[Case], *, verbose: bool = True) -> CheckResult:
    """Run ``cases`` against ``candidate`` in order; stop and explain at the first failure."""
    lines: list[str] = []
    result = CheckResult(title, False, len(cases), 0, lines=lines)
    for i, case in enumerate(cases, 1):
        try:
            got = case.run(candidate)
        except NotImplementedError as exc:
            lines.append(f"{title}: not implemented yet -- {exc}" if str(exc) else f"{title}: not implemented yet")
            result.not_implemented = True
            result.failed_case = case.name
            break
        except Exception as exc:  # the learner's bug: show it as a failed case, not a crash
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" (line {tb[-1].lineno} in {tb[-1].name})" if tb else ""
            lines.append(f"✘ case {i}/{len(cases)} '{case.name}': raised {type(exc).__name__}: {exc}{where}")
            try:  # as for a wrong answer below: a diagnosis that cannot tell (or fails) leaves the case's hint
                hint = (case.diagnose_raise(candidate, exc) if case.diagnose_raise is not None else None) or case.hint
            except Exception:  # noqa: BLE001
                hint = case.hint
            if hint:
                lines.append(f"  hint: {hint}")
            result.failed_case = case.name
            break
        try:
            ok = bool(case.passes(got))
        except Exception as exc:  # noqa: BLE001 - e.g. a numpy array, whose ``==`` has no single truth value
            ok = False
            lines.append(f"✘ case {i}/{len(cases)} '{case.name}': the answer could not be compared "
                         f"({type(exc).__name__}: {exc}); return plain Python values (a list, an int), "
                         f"not a {type(got).__name__}")
            result.failed_case = case.name
            break
        if ok:
            result.num_passed += 1
            lines.append(f"✔ {case.name}")
            continue
        expected = case.show_expected if case.show_expected is not None else _short(case.expected)
        lines.append(f"✘ case {i}/{len(cases)} '{case.name}'")
        lines.append(f"  expected: {expected}")
        lines.append(f"  got:      {_short(got)}")
        try:  # (not for a case that compares its own way, or hides its expected value)
            differs = _dict_difference(got, case.expected) if case.accept is None and case.show_expected is None else None
        except Exception:  # noqa: BLE001 - values whose == is not a plain bool
            differs = None
        if differs:
            lines.append(f"  differs:  {differs}")
        try:  # the right values in the wrong container: say so, not the hint for a wrong value
            hint = _container_difference(got, case.expected) if case.accept is None else None
        except Exception:  # noqa: BLE001 - values whose == is not a plain bool
            hint = None
        if hint is None:
            try:  # a diagnosis reads an answer of any shape; one it cannot read falls back to the case's hint
                hint = (case.diagnose(got) if case.diagnose is not None else None) or case.hint
            except Exception:  # noqa: BLE001
                hint = case.hint
        if hint:
            lines.append(f"  hint: {hint}")
        result.failed_case = case.name
        break
    else:
        result.passed = True
        lines.append(f"{title}: all {len(cases)} cases passed")
    if verbose:
        print("\n".join(lines))
    return result


def choose(result: CheckResult, mine: Any, reference: Any, what: str = "implementation") -> Any:
    """The learner's ``mine`` if its checker passed, else the engine's ``reference``.

    Later cells of a lab use the returned object, so a stuck learner still gets
    every experiment, widget and figure of the lab.
    """
    if result:
        print(f"using your {what}")
        return mine
    print(f"using the engine's {what} (yours has not passed its checker yet)")
    return reference


def expect_raises(exc_type: type[BaseException], fn: Callable[[], Any]) -> str:
    """Run ``fn``; return the name of what it raised, or 'no error' (for cases on errors).

    ``NotImplementedError`` is re-raised so a stub still reads "not implemented yet".
    """
    try:
        fn()
    except NotImplementedError:
        raise
    except exc_type:
        return exc_type.__name__
    except Exception as exc:  # a different error type counts as wrong
        return type(exc).__name__
    return "no error"
