"""Compatibility view: numeric quiz answers now live with their lab.

Each lab's ``check_labNN.py`` holds its own ``quiz_*`` functions next to its
checkers and its registration (one place per lab), and the banks name them as
``"compute": "minivllm.labs.check_labNN:quiz_<name>"``.  This module keeps the
old spelling ``minivllm.labs.answers:labNN_<name>`` working for anything that
still uses it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def __getattr__(name: str) -> Callable[[], Any]:
    """``labNN_<name>`` -> ``check_labNN.quiz_<name>``, looked up when asked for.

    Why a module ``__getattr__`` and not a table: a table built at import would import every lab's
    checker module (and torch with them) to answer one quiz question; this imports only the one asked for.
    """
    lab, _, rest = name.partition("_")
    if not (lab.startswith("lab") and lab[3:].isdigit() and rest):
        raise AttributeError(name)
    module = importlib.import_module(f"minivllm.labs.check_{lab}")
    try:
        return getattr(module, f"quiz_{rest}")
    except AttributeError:
        raise AttributeError(f"{module.__name__} has no quiz answer quiz_{rest}") from None
