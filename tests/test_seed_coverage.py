"""The seed-coverage map (docs/seed_coverage.md) must keep pointing at things that exist.

The map says, for every item of the seed lessons, where the course teaches it and where it is measured. Labs,
tests and benchmarks get renamed; a map that still cites the old names would claim coverage that is gone. So
every reference in its tables is resolved here against the repository as it is now:

* ``labNN::text``            -- ``text`` occurs in the cell sources of ``solutions/labNN_*.ipynb``;
* ``labNN::tag:T``           -- a cell of that solution notebook carries tag ``T``;
* ``tests/x.py::test_name``  -- the file defines ``def test_name(``;
* ``path::text``             -- the file exists and contains ``text`` (JSON also after decoding escapes);
* ``path``                   -- the file exists.

Fast: it reads JSON and text files only, no kernel and no model.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "seed_coverage.md"
STATUSES = ("covered", "taught, not measured", "measured, not taught", "missing")
COLUMNS = ("id", "seed item", "taught in", "measured in", "status")


def _cells(line: str) -> list[str]:
    """Split one markdown table row; the map never puts a pipe inside a cell."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_rows(text: str) -> list[dict[str, str]]:
    """Every data row of every table whose header is exactly COLUMNS (the explanatory tables are skipped)."""
    rows: list[dict[str, str]] = []
    header: tuple[str, ...] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = tuple(cells)
            continue
        if set(line.replace("|", "").strip()) <= {"-", " ", ":"}:
            continue  # the separator row
        if header == COLUMNS:
            rows.append(dict(zip(COLUMNS, cells)))
    return rows


def refs(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@lru_cache(maxsize=None)
def notebook(lab: str) -> tuple[str, frozenset[str]]:
    """(joined cell sources, set of cell tags) of the solution notebook of ``labNN``."""
    found = sorted((ROOT / "solutions").glob(f"{lab}_*.ipynb"))
    if len(found) != 1:
        raise AssertionError(f"{lab}: expected one solution notebook, found {[p.name for p in found]}")
    nb = json.loads(found[0].read_text(encoding="utf-8"))
    sources, tags = [], set()
    for cell in nb["cells"]:
        src = cell["source"]
        sources.append(src if isinstance(src, str) else "".join(src))
        tags.update(cell.get("metadata", {}).get("tags", []))
    return "\n".join(sources), frozenset(tags)


@lru_cache(maxsize=None)
def file_text(rel: str) -> str:
    path = ROOT / rel
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":  # quiz banks may store non-ASCII as \\u escapes: search the decoded text too
        text += "\n" + json.dumps(json.loads(text), ensure_ascii=False, indent=1)
    return text


def resolve(ref: str) -> str | None:
    """None when the reference holds, else why it does not."""
    target, sep, needle = ref.partition("::")
    if re.fullmatch(r"lab\d\d", target):
        if not sep or not needle:
            return "a lab reference needs ::text or ::tag:T"
        try:
            source, tags = notebook(target)
        except AssertionError as err:
            return str(err)
        if needle.startswith("tag:"):
            return None if needle[4:] in tags else f"no cell tagged {needle[4:]!r} in {target}'s solution notebook"
        return None if needle in source else f"{needle!r} not in {target}'s solution notebook"
    path = ROOT / target
    if "/" not in target or not path.is_file():
        return f"no file {target}"
    if not sep:
        return None
    text = file_text(target)
    if target.startswith("tests/") and needle.startswith("test_"):
        return None if re.search(rf"^\s*def {re.escape(needle)}\(", text, re.M) else f"{target} defines no {needle}"
    return None if needle in text else f"{needle!r} not in {target}"


@lru_cache(maxsize=None)
def notebook_outputs(lab: str) -> str:
    """The stored text outputs of ``labNN``'s solution notebook: where the numbers the map quotes were printed."""
    found = sorted((ROOT / "solutions").glob(f"{lab}_*.ipynb"))
    if len(found) != 1:
        return ""  # resolve() already reports the missing notebook
    texts = []
    for cell in json.loads(found[0].read_text(encoding="utf-8"))["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("text", out.get("data", {}).get("text/plain", ""))
            texts.append(text if isinstance(text, str) else "".join(text))
    return "\n".join(texts)


# A number the map quotes: digits with thousands commas and a decimal part, not the tail of a name (A2.10, lab05,
# H100, p95) or of a longer number.
NUMBER = re.compile(r"(?<![\w.,])\d(?:[\d,]*\d)?(?:\.\d+)?")

# Numbers a row quotes on purpose from no stored output: A2.11 keeps the quiet and busy runs of 1-5 December as
# history (the lab's stored output is the later rerun it also quotes).
UNBACKED = {"A2.11": {"12", "18", "6.1", "2.0", "5.7", "13"}}


def quoted_numbers(row: dict[str, str]) -> set[str]:
    """Numbers of two or more digits in a row's measurements and status, outside its references, without commas."""
    text = re.sub(r"`[^`]*`", " ", row["measured in"] + " " + row["status"])
    return {n.replace(",", "") for n in NUMBER.findall(text) if sum(c.isdigit() for c in n) >= 2}


def cited_text(row: dict[str, str]) -> str:
    """Everything a row cites: its labs' cell sources and stored outputs, and the text of its other files."""
    parts = []
    for col in ("taught in", "measured in", "status"):
        for ref in refs(row[col]):
            target = ref.partition("::")[0]
            if re.fullmatch(r"lab\d\d", target):
                parts += [notebook(target)[0], notebook_outputs(target)]
            elif "/" in target and (ROOT / target).is_file():
                parts.append(file_text(target))
    return "\n".join(parts)


ROWS = parse_rows(MAP.read_text(encoding="utf-8"))


def test_the_map_parses_into_many_items_with_unique_ids_and_known_statuses():
    assert len(ROWS) >= 60, f"only {len(ROWS)} items parsed from {MAP.name}: is a table header broken?"
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)), "duplicate ids"
    for r in ROWS:
        assert r["status"].startswith(STATUSES), f"{r['id']}: unknown status {r['status']!r}"


def test_statuses_agree_with_the_references():
    """'covered' needs both a teaching and a measuring reference; 'taught…' needs a teaching one."""
    for r in ROWS:
        taught, measured = refs(r["taught in"]), refs(r["measured in"])
        if r["status"].startswith("covered"):
            assert taught and measured, f"{r['id']} is 'covered' but cites nothing in one column"
        elif r["status"].startswith("taught"):
            assert taught, f"{r['id']} is 'taught' but cites no lab"
        elif r["status"].startswith("measured"):
            assert measured, f"{r['id']} is 'measured' but cites nothing"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_every_reference_exists(row):
    bad = [f"{ref}: {why}" for col in ("taught in", "measured in") for ref in refs(row[col])
           if (why := resolve(ref)) is not None]
    assert not bad, f"{row['id']} ({row['seed item'][:60]}): stale references\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_every_number_a_row_quotes_occurs_in_what_it_cites(row):
    """A row's numbers are read off a stored output or a result file; when a rerun changes that output, the map must
    change with it, or it quotes a measurement nobody can find.  The check is textual (the number occurs somewhere in
    what the row cites), so it catches a stale or mistyped number, not one that matches by coincidence."""
    cited = cited_text(row).replace(",", "")
    missing = sorted(n for n in quoted_numbers(row) - UNBACKED.get(row["id"], set()) if n not in cited)
    assert not missing, f"{row['id']} quotes numbers that nothing it cites shows: {missing}"


def test_the_number_check_sees_a_changed_number():
    row = next(r for r in ROWS if r["id"] == "A1.2")
    assert {"5.3", "23.6", "1536"} <= quoted_numbers(row)
    assert "23.6" in cited_text(row) and "23.4" not in cited_text(row)


@pytest.mark.parametrize("ref", [
    "lab02::a sentence no lab contains, 7c1e",
    "lab02::tag:exercise:no_such_exercise",
    "lab99::## 1.",
    "tests/test_seed_coverage.py::test_that_does_not_exist",
    "minivllm/labs/quizzes/lab02.json::a question nobody asked",
    "benchmarks/results/no_such_result.json",
])
def test_the_resolver_rejects_references_that_do_not_hold(ref):
    assert resolve(ref) is not None


def test_the_resolver_accepts_what_exists():
    for ref in ("lab02::tag:exercise:block_pool", "lab02::## Retrieval check",
                "tests/test_seed_coverage.py::test_the_resolver_accepts_what_exists",
                "minivllm/labs/quizzes/lab02.json::What problem does PagedAttention primarily solve?"):
        assert resolve(ref) is None, ref
