"""Writing a benchmark's result file: the numbers, the command that made them, and the machine.

A JSON under ``benchmarks/results/`` is evidence only if a reader can rerun it and knows
what it ran on, so each file carries the exact command line and a few machine facts next
to the numbers.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from typing import Any, Sequence


def json_safe(x: Any) -> Any:
    """inf -> "inf", nan -> None, recursively, non-string keys as strings: strict JSON has none of them."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else str(json_safe(k))): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def cpu_from_cpuinfo(text: str) -> str | None:
    """The first processor of a ``/proc/cpuinfo`` as one line: model name, family / model / stepping, clock.

    Why more than the model name: a cloud VM reports "AMD EPYC" for several generations of chip, and this
    course's 2-core VM ran the same engine 1.4-2.6x apart on two days' hosts; the family and model numbers
    tell those hosts apart (AMD family 25 is Zen 3 / Zen 4, 26 is Zen 5), the name does not.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: a VM's cores are alike
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or fields.get("Processor") or fields.get("cpu model")
    if not name:
        return None
    ids = "/".join(fields[k] for k in ("cpu family", "model", "stepping") if k in fields)
    mhz = fields.get("cpu MHz")
    return name + (f" (family/model/stepping {ids})" if ids else "") + (f" @ {float(mhz):.0f} MHz" if mhz else "")


def cpu_identity() -> str:
    """This machine's CPU as :func:`cpu_from_cpuinfo` names it (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            found = cpu_from_cpuinfo(fh.read())
    except OSError:
        found = None
    return found or platform.processor() or platform.machine() or "unknown"


def cpu_times_from_stat(text: str) -> dict[str, int] | None:
    """The machine-wide ``cpu`` line of a ``/proc/stat``: ticks spent per state since boot (``steal`` and later
    states are absent on old kernels and count as 0)."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            ticks = [int(x) for x in parts[1:1 + len(names)]]
            return dict(zip(names, ticks + [0] * (len(names) - len(ticks))))
    return None


def cpu_times() -> dict[str, int] | None:
    """:func:`cpu_times_from_stat` of this machine, or None where there is no ``/proc/stat`` (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii", errors="replace") as fh:
            return cpu_times_from_stat(fh.read())
    except OSError:
        return None


def steal_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """The share of this VM's CPU time between two :func:`cpu_times` readings that the hypervisor ran other
    guests instead ("steal").

    Why it is recorded beside the load average: a neighbour on the same physical host never shows in this
    machine's load average, yet it takes cores from under a timed run; steal is the one place a guest sees it.
    A run can still move with no steal (a neighbour sharing caches and memory bandwidth, clock changes), so a
    zero says only that the cores were not taken away.
    """
    if before is None or after is None:
        return None
    total = sum(after.values()) - sum(before.values())
    return (after["steal"] - before["steal"]) / total if total > 0 else None


def machine() -> dict[str, Any]:
    """What the numbers depend on: core count, the CPU, platform, Python and torch versions, load."""
    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "cpu": cpu_identity(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = list(os.getloadavg())
    return info


def write_result(path: str | os.PathLike, doc: dict[str, Any], prog: str,
                 argv: Sequence[str] | None = None) -> None:
    """Write ``doc`` as JSON to ``path`` with ``command`` and ``machine`` keys added first (a ``doc`` that
    has either key is refused: it would silently replace the rerun command or the machine facts)."""
    clash = {"command", "machine"} & set(doc)
    if clash:
        raise ValueError(f"write_result adds {sorted(clash)} itself; name the benchmark's own key differently")
    args = list(sys.argv[1:] if argv is None else argv)
    full = {"command": " ".join([prog, *args]), "machine": machine(), **doc}
    write_json(path, json_safe(full))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as JSON at ``path``, whole or not at all: written to a file beside it, then renamed over it.

    Why: ``sim_accuracy`` rewrites its result and profile after each workload so that a time box that kills it
    keeps them; a kill (``timeout``'s SIGTERM) while a plain ``open(path, "w")`` was writing left a truncated
    file, losing the checkpoint written before it too.  A rename within one directory is atomic.  A path that
    is not a plain file (``--out /dev/stdout``, a pipe, a link) is written through, as it always was: a rename
    would replace the device or the link itself.
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=1)
        return
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(partial, path)


def times(ratio: float, above: str, below: str, digits: int = 2) -> str:
    """``ratio`` said as a factor of at least 1 with its direction in a word: ``times(0.8, "lower", "higher")``
    is ``"1.25x higher"``.  Why: "0.8x lower" reads as lower to anyone who takes the word at its meaning; a
    factor under 1 next to a direction word is how a benchmark line comes to say the opposite of its numbers."""
    return f"{max(ratio, 1 / ratio):.{digits}f}x {above if ratio >= 1 else below}"
