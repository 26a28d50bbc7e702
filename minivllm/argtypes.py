"""``type=`` functions for the command lines: a nonsensical number is refused where it is typed.  And the two
value tests the Python API's own boundary checks share (:func:`is_int`, :func:`is_real`).

Why here and not deeper?  Without them ``--num-requests 0`` ran an empty
benchmark and exited 0, ``--block-size 0`` died in a ``ZeroDivisionError``
traceback after the model loaded, and ``--num-requests -3`` reported numpy's
"negative dimensions are not allowed".  As a ``type=`` the same value gets
argparse's one-line ``error: argument --num-requests: ...`` and exit status 2,
before anything runs.
"""

from __future__ import annotations

import argparse
import math
import os


def is_int(x) -> bool:
    """An integer that is not a bool: ``True`` is an ``int`` to Python, and a flag passed for a count (``n=True``)
    would run as 1 in silence.  numpy integers are not taken (the callers check values a user typed or loaded
    from JSON, which are plain ints)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A finite int or float that is not a bool (a time, a rate, a threshold): NaN compares false with every
    bound, so a range check alone lets it through; inf passes most lower bounds.  An int past float's range
    (``10**400``) is no finite float either: ``math.isfinite`` raises ``OverflowError`` on it rather than answering,
    which escaped every caller's ``ValueError``."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (a count, a size)."""
    n = _number(text, int)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    n = _number(text, int)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return n


def positive_float(text: str) -> float:
    """A finite number > 0 (a duration, an SLO, a scale)."""
    x = _number(text, float)
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return x


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    x = _number(text, float)
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return x


def seconds_or_off(text: str) -> float:
    """A finite number of seconds >= 0, or ``off``: never, read as ``math.inf``.

    ``inf`` rather than ``None`` because ``None`` already means "not given, keep the default"
    to the callers that forward options; each caller turns ``inf`` into its own "no limit".
    """
    if text.strip().lower() == "off":
        return math.inf
    try:
        x = float(text)
    except ValueError:
        x = math.nan  # a word: the refusal names 'off', the one word taken (``none`` got "expected a number")
    if not x >= 0:  # (inf is "off" spelled as a number; nan is neither)
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 or 'off', got {text!r}")
    return x


def bytes_or_off(text: str) -> float:
    """A byte count >= 1, or ``off``: no limit, read as ``math.inf`` (as :func:`seconds_or_off`, for the same
    reason: ``None`` is "not given, keep the default")."""
    if text.strip().lower() == "off":
        return math.inf
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes >= 1 or 'off', got {text!r}") from None


def positive_rate(text: str) -> float:
    """A rate > 0; ``inf`` allowed (the load generator's "everything at once")."""
    x = _number(text, float)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return x


def fraction(text: str) -> float:
    """A number in (0, 1] (a share of memory, a goodput target)."""
    x = _number(text, float)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return x


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port)."""
    n = _number(text, int)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}")
    return n


def output_file(text: str) -> str:
    """A result file to write: not empty, not a directory.

    Checked where it is typed because the file is written last: ``--json ''`` wrote nothing and exited 0, and
    ``--out ''`` or ``--out DIR`` failed with ``Is a directory: '.'`` only after the whole benchmark had run.
    A name ending in a separator (``--out results/``) names a directory too, one that need not exist yet: the
    writer resolves the path, which drops the separator, so the run wrote a *file* called ``results`` in silence.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}")
    if os.path.isdir(text) or text.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    return text


def unwritable(path: str) -> str | None:
    """Why no file can be written at ``path``, or None: the directory it goes in (or, when that is missing, the
    nearest one that exists, where :func:`minivllm.bench.results.write_json` makes the rest) is no directory or
    takes no new file.  A path that exists and is not a plain file (``/dev/stdout``) is written through: None; a
    link that points nowhere is asked of the folder it points into.

    Why: :func:`output_file` looks at the name alone, and a benchmark writes its file last, so ``--out`` under a
    file or in a read-only folder failed after the whole run, with an OSError quoting the path whole.  Asked by
    making (and dropping) a file there, as the writer will: the permission bits do not tell (root ignores them,
    and ``/proc`` refuses root).
    """
    import tempfile

    path = os.path.abspath(path)
    if os.path.islink(path):
        if os.path.exists(path):  # a live link is written through (``/dev/stdout``)
            return None
        path = os.path.realpath(path)  # a dead one: the file is made where it points
    elif os.path.exists(path) and not os.path.isfile(path):
        return None
    folder = os.path.dirname(path)
    while not os.path.lexists(folder):  # (ends at the root, which exists)
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{brief_path(folder)} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            return None
    except OSError as exc:
        return f"{brief_path(folder)} takes no new file ({exc.strerror or type(exc).__name__})"


def comma_list(item):
    """``type=`` for ``A,B,C``: each item through ``item``; the error names the bad one."""

    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
        out = []
        for p in parts:
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{p!r} in {text!r}: {exc}") from None
        return out

    return parse


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, dests) -> list[str]:
    """The flags among ``dests`` (destinations) that the command line gave: those not at None (False for a switch).

    A flag that only some modes read has None as its parser default, so that one given, even with the value its
    help states, can be told from one left alone; the caller puts the stated value in after its checks.
    """
    return [max(a.option_strings, key=len) for a in parser._actions  # (``is``: a count of 0 == False is given)
            if a.dest in dests and a.option_strings and getattr(args, a.dest) is not None
            and getattr(args, a.dest) is not False]


def refuse_unread(parser: argparse.ArgumentParser, args: argparse.Namespace, dests, why: str) -> None:
    """``parser.error`` naming each flag among ``dests`` that the command line gave (:func:`given_flags`), where the
    mode ``why`` names (the flag that chose it, and what that mode does instead) reads none of them.

    Why: such a flag was dropped without a word, and its run looked like one that had honoured it.
    """
    given = given_flags(parser, args, dests)
    if given:
        parser.error(f"argument {given[0]}: not read {why}: drop {', '.join(given)}")


PATH_CHARS = 200
"""Most characters of a path an error message quotes: room for this project's own file names whole (a result
file's name runs to 70 characters), not for a generated or pasted path of thousands."""


def brief_path(path) -> str:
    """``path`` quoted for an error message, cut in the middle when it is long: its file name is kept whole.

    Why not a cut at the end, as other values are quoted: the part of a path that tells a user which file was
    meant is its file name (``benchmarks/results/2026-11-30_..._run2.json``: the date tells the runs apart),
    and quoted whole a path of thousands of characters flooded the terminal with a one-line error.  The cut is
    made in the text before it is quoted, so no escape sequence is split.  (Here, with the flag helpers, because
    ``bench ab --same-bench`` copies this module beside a benchmark script: it holds no engine code.)
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        path = path.decode("utf-8", "backslashreplace")
    if not isinstance(path, str):
        text = repr(path)
        return text if len(text) <= PATH_CHARS else text[:PATH_CHARS] + "..."
    if len(path) <= PATH_CHARS:
        return repr(path)
    name = path[-(len(os.path.basename(path)) + 1):][-(PATH_CHARS - 20):]  # its separator too (a name of
    # thousands is cut as well, from its start)
    return repr(path[:PATH_CHARS - len(name) - 3] + "..." + name)
