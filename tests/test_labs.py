"""Mechanics of the lab course: generator, signatures, checkers (mutation scores), quizzes, widgets.

Fast (no model, no kernel): the notebooks themselves are executed by
``tests/test_notebooks.py``.
"""

from __future__ import annotations

import ast
import io
import json
import math
import sys
from contextlib import redirect_stdout
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402

from minivllm.labs import check_lab02, check_lab03, check_lab04, check_lab05, quiz, widgets, workloads  # noqa: E402
from minivllm.labs.grade import exercise_cells as _exercise_cells  # noqa: E402
from minivllm.labs.registry import Exercise, Lab, MutantError, apply_mutant, labs  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
LABS = ROOT / "labs"

# Everything below is discovered from the registry: a new lab's ``LAB = Lab(...)`` is tested
# (checkers, planted bugs, hidden cases, quiz, notebooks) with no edit to this file.
REGISTERED: tuple[Lab, ...] = labs()
EXERCISES: list[tuple[Lab, Exercise]] = [(lab, ex) for lab in REGISTERED for ex in lab.exercises]
EX_IDS = [ex.name for _, ex in EXERCISES]


def _nb(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _setup_source(nb) -> str:
    cells = [c for c in nb.cells if "setup" in c.metadata.get("tags", [])]
    assert cells, "a lab notebook needs a cell tagged 'setup'"
    return "\n".join(line for c in cells for line in c.source.splitlines() if not line.lstrip().startswith("%"))


def _notebook(lab: Lab, folder: Path) -> Path:
    return folder / f"{lab.stem}.ipynb"


def _load(lab: Lab, ex: Exercise, source: str | None = None, folder: Path | None = None):
    nb = _nb(_notebook(lab, folder or ROOT / "solutions"))
    ns: dict = {}
    exec(compile(_setup_source(nb), f"<{lab.stem} setup>", "exec"), ns)
    exec(compile(source if source is not None else _exercise_cells(nb)[ex.name], f"<{ex.name}>", "exec"), ns)
    return ns[ex.defines]


def _run_checker(ex: Exercise, obj):
    with redirect_stdout(io.StringIO()) as buf:
        result = ex.check(obj)
    plt.close("all")
    return result, buf.getvalue()


# -- the generator ----------------------------------------------------------------------


def test_labs_are_generated_from_solutions():
    """CI's regeneration check: labs/ must be exactly what make_labs.py writes."""
    assert SOLUTIONS, "no solution notebooks"
    assert make_labs.main(["--check"]) == 0, "labs/ is stale: run python tools/make_labs.py"


def test_stub_replaces_region_and_keeps_hints():
    src = "def f(x):\n    # TODO: square x,\n    #   as an int\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION\n"
    out = make_labs.stub_source(src)
    assert "return x * x" not in out and "BEGIN SOLUTION" not in out
    assert "    raise NotImplementedError('square x, as an int')" in out
    assert "# TODO: square x," in out
    assert "raise NotImplementedError('replace this line with your code')" in make_labs.stub_source(
        "### BEGIN SOLUTION\nx = 1\n### END SOLUTION")


@pytest.mark.parametrize("src", ["### BEGIN SOLUTION\nx", "### END SOLUTION", "### BEGIN SOLUTION\n### BEGIN SOLUTION\n"])
def test_unbalanced_markers_fail(src):
    with pytest.raises(make_labs.MarkerError):
        make_labs.stub_source(src)


def test_check_mode_detects_drift(tmp_path):
    labs = tmp_path / "labs"
    assert make_labs.main(["--labs", str(labs)]) == 0
    assert make_labs.main(["--check", "--labs", str(labs)]) == 0
    first = sorted(labs.glob("*.ipynb"))[0]
    first.write_text(first.read_text().replace("NotImplementedError", "NotImplementedErr", 1))
    assert make_labs.main(["--check", "--labs", str(labs)]) == 1


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_lab_notebooks_have_no_solutions_or_outputs(path):
    lab = _nb(LABS / path.name)
    for cell in lab.cells:
        if cell.cell_type == "code":
            assert "BEGIN SOLUTION" not in cell.source
            assert cell.outputs == [] and cell.execution_count is None
    for name, source in _exercise_cells(lab).items():
        assert "raise NotImplementedError(" in source, name


def _signatures(source: str) -> list:
    """Public shape of a cell: top-level defs and classes with their methods, arguments and defaults."""
    def sig(fn):
        a = fn.args
        return (fn.name, [x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs],
                len(a.defaults), [ast.unparse(d) for d in fn.decorator_list],
                ast.unparse(fn.returns) if fn.returns else None)

    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(("def",) + sig(node))
        elif isinstance(node, ast.ClassDef):
            methods = [sig(m) for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            out.append(("class", node.name, [ast.unparse(b) for b in node.bases], methods))
    return out


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_public_signatures_match(path):
    sol, lab = _nb(path), _nb(LABS / path.name)
    assert len(sol.cells) == len(lab.cells)
    for i, (a, b) in enumerate(zip(sol.cells, lab.cells)):
        assert a.cell_type == b.cell_type
        if a.cell_type == "code" and not a.source.lstrip().startswith("%"):
            src_a = "\n".join(x for x in a.source.splitlines() if not x.lstrip().startswith("%"))
            src_b = "\n".join(x for x in b.source.splitlines() if not x.lstrip().startswith("%"))
            assert _signatures(src_a) == _signatures(src_b), f"{path.name} cell {i}"


def test_every_notebook_is_a_registered_lab():
    """A lab in solutions/ without a ``LAB`` registration would be skipped by the tests and the grader."""
    assert {p.stem for p in SOLUTIONS} == {lab.stem for lab in REGISTERED}
    names = [ex.name for _, ex in EXERCISES]
    assert len(set(names)) == len(names), "exercise names must be unique course-wide"
    assert len({lab.number for lab in REGISTERED}) == len(REGISTERED)


@pytest.mark.parametrize("lab", REGISTERED, ids=lambda lab: lab.stem)
def test_every_lab_has_two_exercises_and_a_quiz(lab):
    assert len(lab.exercises) >= 2, lab.stem
    assert all(ex.points >= 1 for ex in lab.exercises)
    nb = _nb(_notebook(lab, ROOT / "solutions"))
    cells = _exercise_cells(nb)
    for ex in lab.exercises:
        assert ex.name in cells, f"{lab.stem}: no cell tagged exercise:{ex.name}"
        assert ex.defines in cells[ex.name], f"{lab.stem}: the exercise:{ex.name} cell does not define {ex.defines}"
    assert lab.quiz and (quiz.BANK_DIR / f"{lab.quiz}.json").exists(), lab.stem
    assert "show_quiz(" in "".join(c.source for c in nb.cells)


# -- checkers: accept the reference, reject every planted bug, stubs read "not implemented" ----


@pytest.mark.parametrize("lab,ex", EXERCISES, ids=EX_IDS)
def test_checker_accepts_solution(lab, ex):
    result, text = _run_checker(ex, _load(lab, ex))
    assert result, text
    assert result.num_passed == result.num_cases


@pytest.mark.parametrize("lab,ex", EXERCISES, ids=EX_IDS)
def test_checker_says_not_implemented_for_stub(lab, ex):
    obj = _load(lab, ex, _exercise_cells(_nb(_notebook(lab, LABS)))[ex.name])
    result, text = _run_checker(ex, obj)
    assert not result and result.not_implemented
    assert "not implemented yet" in text and "Traceback" not in text


MUTATION_SCORES: dict[str, tuple[int, int]] = {}


@pytest.mark.parametrize("lab,ex", EXERCISES, ids=EX_IDS)
def test_checker_rejects_planted_bugs(lab, ex):
    """Every mutant must fail its checker; at least 5 mutants per exercise."""
    assert len(ex.mutants) >= 5, ex.name
    source = _exercise_cells(_nb(_notebook(lab, ROOT / "solutions")))[ex.name]
    survivors = []
    for mutant in ex.mutants:
        mutated = apply_mutant(source, mutant)
        assert mutated != source, mutant[0]
        try:
            obj = _load(lab, ex, mutated)
        except Exception:  # a mutant that does not even define the object is caught trivially
            continue
        result, text = _run_checker(ex, obj)
        if result:
            survivors.append(mutant[0])
        else:
            assert "✘" in text or "not implemented" in text
    MUTATION_SCORES[ex.name] = (len(ex.mutants) - len(survivors), len(ex.mutants))
    print(f"mutation score {ex.name}: {len(ex.mutants) - len(survivors)}/{len(ex.mutants)}")
    assert not survivors, f"{ex.name}: the checker accepts planted bugs {survivors}"


def test_a_stale_mutant_fails_loudly():
    with pytest.raises(MutantError):
        apply_mutant("x = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\n", ("gone", "x = 1", "x = 2"))


# -- hidden cases: the grader's extra, seeded inputs ------------------------------------------


HIDDEN = [(lab, ex) for lab, ex in EXERCISES if ex.hidden is not None]


@pytest.mark.parametrize("lab,ex", HIDDEN, ids=[ex.name for _, ex in HIDDEN])
def test_hidden_cases_accept_solution(lab, ex):
    obj = _load(lab, ex)
    for seed in (0, 12345):
        result = ex.hidden(obj, seed)
        assert result, (seed, result.lines)


@pytest.mark.parametrize("lab", [lab for lab in REGISTERED if lab.number <= 5], ids=lambda lab: lab.stem)
def test_labs_1_to_5_have_hidden_cases(lab):
    assert all(ex.hidden is not None for ex in lab.exercises), lab.stem


@pytest.mark.parametrize("lab,ex", HIDDEN, ids=[ex.name for _, ex in HIDDEN])
def test_hidden_cases_catch_planted_bugs_on_their_own(lab, ex):
    """The hidden cases alone (without the visible checker) reject most planted bugs: they test the rule,
    not a few examples.  (A bug only the visible edge cases pin down may pass them.)"""
    source = _exercise_cells(_nb(_notebook(lab, ROOT / "solutions")))[ex.name]
    caught = 0
    for mutant in ex.mutants:
        try:
            obj = _load(lab, ex, apply_mutant(source, mutant))
            with redirect_stdout(io.StringIO()):
                ok = bool(ex.hidden(obj, 7))
        except Exception:
            ok = False
        caught += not ok
    plt.close("all")
    assert caught >= 0.6 * len(ex.mutants), f"{ex.name}: hidden cases catch only {caught}/{len(ex.mutants)}"


def test_hidden_cases_defeat_a_lookup_table():
    """An answer that memorises the visible cases passes the checker and fails the hidden cases."""
    visible = {((), 16): 0, ((1,), 16): 16, ((16,), 16): 16, ((17,), 16): 32, ((1, 16, 17, 40), 16): 112,
               ((3, 5, 7), 1): 15, ((0, 5), 16): 16,
               ((16, 16, 5, 5), 16): 64}

    def memorised(seq_lens, block_size):
        return visible.get((tuple(seq_lens), block_size), 0)

    _, ex = next((lab, ex) for lab, ex in EXERCISES if ex.name == "paged_slots")
    with redirect_stdout(io.StringIO()):
        assert ex.check(memorised)
    assert not ex.hidden(memorised, 1) and not ex.hidden(memorised, 2)


def test_fallbacks_come_from_the_engine_and_pass_their_checkers():
    """Labs hand out the engine's code by name as fallbacks, never the checkers' private references."""
    assert not hasattr(check_lab03, "engine_reference") and not hasattr(check_lab04, "engine_reference")
    text = (ROOT / "tools" / "lab_texts" / "lab04_chunked_prefill.py").read_text()
    assert "engine_reference" not in text and "engine_itl_stats as ref_itl_stats" in text
    with redirect_stdout(io.StringIO()):
        assert check_lab04.check_build_batch(check_lab04.engine_build_batch)
        assert check_lab04.check_itl_stats(check_lab04.engine_itl_stats)
        assert check_lab04.check_pick_budget(check_lab04.engine_pick_budget)
        assert check_lab05.check_victim_policy(check_lab05.ReferenceVictim)
        assert check_lab05.check_swap_or_recompute(check_lab05.reference_swap_or_recompute)


def test_checker_output_shows_case_expected_got_and_hint():
    def wrong(seq_lens, block_size):
        return sum(n // block_size * block_size for n in seq_lens)

    with redirect_stdout(io.StringIO()) as buf:
        result = check_lab02.check_paged_slots(wrong)
    text = buf.getvalue()
    assert not result and result.failed_case == "one token needs a whole block"
    assert "expected: 16" in text and "got:      0" in text and "hint:" in text


def _paged_blocks_not_slots(seq_lens, block_size):
    return sum(-(-n // block_size) for n in seq_lens)


def _itl_of_merged_streams(token_times, q=99):
    times = sorted(t for ts in token_times.values() for t in ts)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return (gaps[max(math.ceil(q / 100 * len(gaps)), 1) - 1], gaps[-1]) if gaps else (0.0, 0.0)


class _VictimByAllTokens:
    """Lab 5: "least work" read as the fewest tokens in all (prompt + output), not the ones in the KV cache."""

    def __init__(self, protected_tenants=("chat",)):
        self.protected = set(protected_tenants)

    def choose_victim(self, running):
        candidates = [r for r in running if r.tenant not in self.protected] or list(running)
        return min(reversed(candidates), key=lambda r: r.num_tokens)


class _VictimNewestWhenAllProtected(_VictimByAllTokens):
    """Lab 5: the rules for the unprotected, and the engine's default (the newest) when everyone is protected."""

    def choose_victim(self, running):
        candidates = [r for r in running if r.tenant not in self.protected]
        if not candidates:
            return running[-1]
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)


def _door_pressure_on_a_busy_engine(stats, max_waiting, min_free_blocks):
    """Lab 5: rule 2 read as "the engine is busy" (anyone running or waiting) instead of "someone is waiting"."""
    busy = stats["num_waiting"] + stats["num_running"] > 0
    return stats["num_waiting"] >= max_waiting or (busy and stats["available_blocks"] < min_free_blocks)


@pytest.mark.parametrize("check, wrong, mistake", [
    (check_lab02.check_paged_slots, _paged_blocks_not_slots, "number of blocks"),
    (check_lab04.check_itl_stats, _itl_of_merged_streams, "merge the lists"),
    (check_lab05.check_victim_policy, _VictimByAllTokens, "not the prompt length or num_tokens"),
    (check_lab05.check_victim_policy, _VictimNewestWhenAllProtected, "choose among all of them"),
    (check_lab05.check_should_reject, _door_pressure_on_a_busy_engine, "someone WAITING"),
], ids=["paged_slots counts blocks", "itl_stats merges the streams", "victim by all tokens",
        "victim: the newest when all are protected", "door: pressure on a busy engine"])
def test_a_typical_mistake_gets_the_hint_for_that_mistake(check, wrong, mistake):
    """The first case these answers fail was written for another bug; its hint alone (``a block is the unit of
    allocation``, ``a request with a single token has no gap``, ``compare with `is None` ``, the engine run's
    "the same victims step by step") points the learner away from theirs."""
    with redirect_stdout(io.StringIO()) as buf:
        assert not check(wrong)
    hint = next(line for line in buf.getvalue().splitlines() if line.lstrip().startswith("hint:"))
    assert mistake in hint, hint


def test_checker_reports_exceptions_as_failed_cases():
    def boom(seq_lens, block_size):
        raise KeyError("oops")

    with redirect_stdout(io.StringIO()) as buf:
        result = check_lab02.check_paged_slots(boom)
    assert not result and "raised KeyError" in buf.getvalue()


def test_choose_falls_back_to_reference():
    with redirect_stdout(io.StringIO()):
        ok = check_lab02.check_paged_slots(workloads.reserved_slots_paged)
        bad = check_lab02.check_paged_slots(lambda lens, bs: 0)
    from minivllm.labs import choose

    with redirect_stdout(io.StringIO()):
        assert choose(ok, "mine", "ref") == "mine"
        assert choose(bad, "mine", "ref") == "ref"


# -- quizzes ----------------------------------------------------------------------------------


BANKS = sorted(quiz.BANK_DIR.glob("lab*.json"))


def test_every_lab_has_a_bank():
    assert {p.stem for p in BANKS} >= {p.stem[:5] for p in SOLUTIONS}


@pytest.mark.parametrize("bank", BANKS, ids=lambda p: p.stem)
def test_quiz_bank_is_valid(bank):
    questions = json.loads(bank.read_text())
    assert len(questions) >= 3
    ids = [q["id"] for q in questions]
    assert len(set(ids)) == len(ids)
    for q in questions:
        assert q["question"].strip() and len(q["why"].strip()) > 20, q["id"]
        assert q["type"] in ("multiple_choice", "numeric")
        for a in q["answers"]:
            assert isinstance(a.get("correct"), bool) and a.get("feedback"), (q["id"], a)
        correct = [a for a in q["answers"] if a["correct"]]
        assert len(correct) == 1, q["id"]
        if q["type"] == "multiple_choice":
            assert len(q["answers"]) >= 3 and all(a["answer"].strip() for a in q["answers"])
        else:
            assert correct[0]["type"] == "value" and "compute" in q, q["id"]
            assert any(a["type"] == "range" for a in q["answers"]), "a catch-all range gives feedback to any number"


@pytest.mark.parametrize("bank", BANKS, ids=lambda p: p.stem)
def test_numeric_answers_match_the_engine(bank):
    for q in json.loads(bank.read_text()):
        if q["type"] == "numeric":
            stored = next(a["value"] for a in q["answers"] if a["correct"])
            assert quiz.compute_answer(q) == stored, f"{bank.stem}/{q['id']}: the engine now says {quiz.compute_answer(q)}"


@pytest.mark.parametrize("bank", BANKS, ids=lambda p: p.stem)
def test_quiz_renders_both_ways(bank):
    questions = json.loads(bank.read_text())
    text = quiz.format_quiz(bank.stem)
    assert "why:" not in text.lower(), "the questions' output must not give the answers away"
    assert "Answer key" not in text
    key = quiz.format_answers(bank.stem)
    assert key.count("why:") == len(questions)
    items = quiz.jupyterquiz_questions(bank.stem)
    # zip() stops at the shorter list: without this, a question dropped from the interactive quiz went unseen
    assert [item["question"] for item in items] == [q["question"] for q in questions]
    for item, q in zip(items, questions):
        assert set(item) <= {"question", "type", "answers", "precision"}
        assert any("Why:" in a["feedback"] for a in item["answers"] if a["correct"])
        if q["type"] == "multiple_choice":  # the interactive quiz shows the same shuffled order as the text
            assert [a["answer"] for a in item["answers"]] == [a["answer"] for a in quiz.shuffled_answers(q)]


@pytest.mark.parametrize("bank", BANKS, ids=lambda p: p.stem)
def test_quiz_options_are_shuffled_deterministically(bank):
    """Correct answers are not all in one position; the order is a function of the question text alone."""
    positions = quiz.correct_positions(bank.stem)
    assert len(positions) >= 2 and len(set(positions)) > 1, f"{bank.stem}: every correct answer at {positions}"
    for q in json.loads(bank.read_text()):
        once, again = quiz.shuffled_answers(q), quiz.shuffled_answers(json.loads(json.dumps(q)))
        assert once == again
        assert sorted(a["answer"] if "answer" in a else str(a) for a in once) == sorted(
            a["answer"] if "answer" in a else str(a) for a in q["answers"])
        assert all(a["feedback"] for a in once), "every option keeps its own why"


def test_recompute_answer_counts_the_victims_tokens_not_the_steps():
    """Lab 5's right answer on why a recompute is cheap once said "a decode step [reads the weights] for one" token:
    false in a batched engine, where lab 1 measured a step of 8 decodes for little more than one (its own quiz: a
    batch of 8 decodes uses each weight it reads for 8 tokens).  What holds is per request: each read serves one of
    the victim's tokens in decode, many of them in prefill."""
    q = next(q for q in quiz.load_bank(5) if q["id"] == "lab01-recompute")
    right = next(a for a in q["answers"] if a["correct"])
    assert "of its tokens" in right["answer"], right["answer"]
    assert "other running requests" in right["feedback"]


def test_the_longest_option_is_not_a_reliable_cue_for_the_right_one():
    """A learner who always picks the longest option must not pass the quizzes: shuffling hides the position of
    the right answer, not its length.  With 3-4 options chance is about 30%; allow an eighth, so that "pick the
    longest" scores well below chance (the banks once had the right answer strictly longest in 48 of 63 questions,
    76%; then in 14, where the right answer carried the whole explanation and the distractors were a few words)."""
    mc = [q for lab in range(1, 10) for q in quiz.load_bank(lab) if q["type"] == "multiple_choice"]
    cued = [q["id"] for q in mc
            if len(next(a for a in q["answers"] if a["correct"])["answer"])
            > max(len(a["answer"]) for a in q["answers"] if not a["correct"])]
    assert len(cued) <= len(mc) // 8, f"{len(cued)} of {len(mc)} right answers are the strictly longest option: {cued}"


def test_quiz_cells_keep_answers_out_of_the_question_output():
    """Each lab prints the questions in one cell and the answer key in a later, separate cell."""
    for path in SOLUTIONS:
        cells = [c.source for c in _nb(path).cells if c.cell_type == "code"]
        q = next(i for i, src in enumerate(cells) if "print_quiz(" in src)
        a = next(i for i, src in enumerate(cells) if "print_answers(" in src)
        assert a > q and "print_answers(" not in cells[q], path.name


def test_lab02_quiz_asks_the_seed_question():
    assert any(q["question"] == "What problem does PagedAttention primarily solve?" for q in quiz.load_bank(2))


@pytest.mark.parametrize("lab", [lab for lab in REGISTERED if lab.number > 1], ids=lambda lab: lab.stem)
def test_later_quizzes_bring_back_earlier_labs(lab):
    assert any(q["question"].startswith(("(From lab", "(Lab")) for q in quiz.load_bank(lab.quiz)), lab.stem


def _solution_lines(source: str) -> list[str]:
    """Code lines inside BEGIN/END SOLUTION regions, stripped, longer than 25 characters."""
    out, inside = [], False
    for line in source.splitlines():
        s = line.strip()
        if s.startswith(make_labs.BEGIN):
            inside = True
        elif s.startswith(make_labs.END):
            inside = False
        elif inside and len(s) > 25:
            out.append(s)
    return out


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_student_notebooks_hold_no_solution_code(path):
    """No line of a solution region may appear in any student notebook (fallbacks, hints, TODOs)."""
    lines = {x for c in _nb(path).cells if c.cell_type == "code" for x in _solution_lines(c.source)}
    assert lines, path.name
    raw = "\n".join(p.read_text() for p in sorted(LABS.glob("*.ipynb")))
    student = "\n".join(c.source for p in sorted(LABS.glob("*.ipynb")) for c in _nb(p).cells)
    leaks = sorted(x for x in lines if x in student or json.dumps(x)[1:-1] in raw)
    assert not leaks, f"{path.name}: solution code in the student notebook: {leaks}"


# Formulas and code that hints, TODOs, docstrings or helper cells once handed over, each the answer (or the line
# that computes it) of an exercise: the ladder must lead the learner to derive it (what matters, which units, a
# worked example with other numbers), not state it.  The nearest-rank line came from a helper cell of lab 1 that
# spelled out lab 4's exercise 2.
HANDED_OVER = (
    "goes out now and comes back later",     # lab 5 swap_or_recompute's TODO: the factor 2
    "candidates or list(running)",           # lab 5 victim policy's hint 2: the candidate line
    "-(-a // b)", "(a + b - 1) // b",        # lab 2 paged_slots's last hint: the ceiling division
    "ceil(len / block_size)",                # ... and its docstring
    "key_i = hash((",                        # lab 3 block_hashes's docstring: the chain
    "q / 100 * n", "math.ceil(q / 100",      # lab 4 itl_stats's hint 2, and lab 1's helper cell
    "the larger of its own and their minimum",  # lab 6 activate's hint 2
    "len(prompt) // block_size",             # lab 9 prefix affinity's hint 2: the key length
)


def test_student_notebooks_hand_over_no_formula():
    text = "\n".join(c.source for p in sorted(LABS.glob("*.ipynb")) for c in _nb(p).cells)
    found = [s for s in HANDED_OVER if s in text]
    assert not found, f"the student notebooks state an exercise's answer: {found}"


# A worked example says "not a checker case": its numbers must then be none of a case's, or the learner who follows
# it has replayed the case instead of applying the method.  Each fragment is a hint's once (the checker's numbers).
REPLAYS_A_CASE = (
    ("lab09", "`block_size` 16, `key_blocks` 2"),  # check_prefix_affinity's kw; its 20-token "partial" prompts
    ("lab05", "0.1 GB/s"),                          # check_swap_or_recompute's "a slow link recomputes" (0.1e9)
)


@pytest.mark.parametrize("lab,fragment", REPLAYS_A_CASE)
def test_worked_examples_use_numbers_of_their_own(lab, fragment):
    path = next(LABS.glob(f"{lab}_*.ipynb"))
    text = "\n".join(c.source for c in _nb(path).cells if c.cell_type == "markdown")
    assert fragment not in text, f"{path.name}: a worked example uses a checker case's numbers: {fragment!r}"


def test_lab03_fallback_is_the_engine_not_a_solution_copy():
    assert not hasattr(check_lab03, "engine_reference")
    source = (ROOT / "tools" / "lab_texts" / "lab03_prefix_caching.py").read_text()
    assert "from minivllm.kv.prefix.hash_index import HashIndex" in source


def test_lab03_collision_demo_serves_blocks_on_the_engine_fallback_too():
    """A learner whose matcher has not passed sees the validated row run on the engine's HashIndex.

    The replay caches under the request's namespace (tenant, salt); a lookup in another namespace matches
    nothing, and the row read "0 blocks served" -- as if validation threw every hit away, the opposite of
    the lesson.  Oracle: the replay's own admission on the same cache finds exactly the blocks the row counts."""
    nb = _nb(LABS / "lab03_prefix_caching.ipynb")
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and '"validated (engine)"' in c.source)
    ns: dict = {}
    exec(compile(_setup_source(nb), "<lab03 setup>", "exec"), ns)
    ns.update(match_check=False, match_prefix=None, picker=None)  # the learner's state before exercise 2 passes
    with redirect_stdout(io.StringIO()) as buf:
        exec(compile(cell, "<lab03 collision demo>", "exec"), ns)
    plt.close("all")
    row = next(line for line in buf.getvalue().splitlines() if line.startswith("validated (engine)"))
    served, wrong = (int(part.split()[0]) for part in row.split(":")[1].split(","))
    pool = ns["BlockPool"](1024)
    records = workloads.replay_prefix_cache(ns["HashIndex"](pool, ns["BLOCK"], hash_fn=ns["weak_engine_hash"]),
                                            pool, ns["prompts"])
    admitted = sum(r["hit_tokens"] for r in records) // ns["BLOCK"]
    assert admitted > 0 and (served, wrong) == (admitted, 0), row


def test_lab06_cap_fallback_admits_what_the_exercise_admits():
    """Until TenantCap passes, lab 6 measures its caps on the engine's fallback, and the lesson under the table
    ("a cap of 4 leaves quiet starving") must hold for it too.  The engine's ``"caps"`` policy also lets a
    tenant whose head request cannot start be passed by the others, which the exercise's order does not do:
    with noisy's prompts waiting for KV that alone rescues quiet.  Oracle: the solution's TenantCap, step by step."""
    from minivllm.labs.check_lab06 import cap_policy, lab_engine, noisy_quiet, serve

    lab = next(lab for lab in REGISTERED if lab.number == 6)
    cap = _load(lab, next(ex for ex in lab.exercises if ex.name == "tenant_cap"))

    def running(policy):
        res = serve(lab_engine(policy), noisy_quiet(4.0), window=4.0)
        return [(r.tenant("noisy").running, r.tenant("quiet").running) for r in res.records]

    caps = {"noisy": 4}
    assert running(cap_policy(None, caps)) == running(cap_policy(cap(caps), caps))


# -- widgets and workloads ---------------------------------------------------------------------


def _small_engine():
    eng = workloads.sim_engine(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, model_max_len=64)
    reqs = workloads.random_requests(4, seed=0, prompt_range=(5, 20), output_range=(3, 8))
    for i, (p, m) in enumerate(reqs):
        from minivllm import SamplingParams

        eng.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=m, ignore_eos=True), f"r{i}")
    return eng, {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}


def test_widgets_draw_real_engine_state():
    eng, lens = _small_engine()
    eng.step()
    eng.step()
    owners = widgets.block_owners(eng)
    assert owners and all(eng.pool.refcount(b) >= 1 for t in owners.values() for b in t)
    widgets.draw_block_pool(eng.pool, owners)
    assert "blocks free" in widgets.describe_block_pool(eng.pool, owners)
    stepper = widgets.Stepper(eng, draw=lambda e, ax: widgets.draw_timeline(e.step_log, lens, ax=ax),
                              describe=lambda e: widgets.describe_step(e.step_log[-1], lens))
    log = stepper.step(10_000)
    assert log.endswith("no work left") and not eng.has_unfinished_requests()
    rows = widgets.timeline_rows(eng.step_log, lens)
    assert sum(1 for r in rows.values() for _, kind, _ in r if kind == "decode") > 0
    widgets.draw_timeline(eng.step_log, lens)
    plt.close("all")


def test_radix_view_shows_locks():
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.prefix.radix import RadixCache

    pool = BlockPool(64)
    cache = RadixCache(pool, 16)
    replay = workloads.PrefixReplay(cache, pool, workloads.multi_turn_workload(2, 3, seed=0))
    for _ in range(4):
        replay.step()
    nodes = widgets.radix_nodes(cache)
    assert any(n["locked"] for n in nodes), "the running request's path is locked"
    assert "locked=" in widgets.describe_radix_tree(cache)
    widgets.draw_radix_tree(cache)
    plt.close("all")


def test_widget_text_fallback_is_stable():
    pytest.importorskip("ipywidgets")
    bundle = widgets._Controls([])._repr_mimebundle_()
    assert bundle["text/plain"].startswith("[step controls")


def recompute_run():
    """Lab 1's small engine overloaded so that requests are preempted (recompute) and re-prefilled, run to the
    end: ``(engine, {request_id: prompt length})``."""
    from minivllm import SamplingParams

    eng = workloads.sim_engine(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, model_max_len=40)
    lens = {}
    for i in range(3):
        lens[f"r{i}"] = 6
        eng.add_request({"prompt_token_ids": [10 + i] * 6}, SamplingParams(max_tokens=20, ignore_eos=True),
                        request_id=f"r{i}")
    workloads.drain(eng)
    return eng, lens


def test_a_reprefill_after_recompute_is_drawn_as_a_prefill():
    """A decode computes one token past the prompt.  A request preempted by recompute computes its prompt *and*
    its outputs again, so a chunk can start past the prompt with many tokens: the pictures called it a 1-token
    decode.  Oracle: the engine's own run, where every chunk past the prompt holding more than one token comes
    after a preemption of that request, and a step's decode tokens are its 1-token chunks past the prompt."""
    eng, lens = recompute_run()
    log = list(eng.step_log)
    redo = [(e["step"], rid) for e in log for rid, s, n in e["seqs"] if s >= lens[rid] and n > 1]
    assert redo, "the run should re-prefill some outputs after a recompute preemption"
    first_preempted: dict = {}
    for e in log:
        for rid in e["preempted"]:
            first_preempted.setdefault(rid, e["step"])
    assert all(first_preempted.get(rid, step) < step for step, rid in redo)
    for e in log:
        decode = sum(n for rid, s, n in e["seqs"] if s >= lens[rid] and n == 1)
        assert widgets.step_composition(e["seqs"], lens) == (e["num_tokens"] - decode, decode)
    rows = widgets.timeline_rows(log, lens)
    assert not [r for r in rows.values() for _, kind, n in r if kind == "decode" and n > 1]
    step, rid = redo[0]
    assert f"{rid} prefill[" in widgets.describe_step(next(e for e in log if e["step"] == step), lens)


def test_budget_explorer_sliders_start_where_the_picture_is():
    """A ``render()`` before ``show()`` moves the picture off the constructor's values; the sliders must follow
    (they started at the defaults while the picture showed the rendered setting)."""
    pytest.importorskip("ipywidgets")
    calls = []

    def simulate(budget, threshold):
        calls.append((budget, threshold))
        return {"step_log": [], "prompt_lens": {}, "itls": [], "title": "", "summary": ""}

    ex = widgets.BudgetExplorer(simulate, budget=(64, 4096, 64, 512), threshold=(0, 2048, 64, 256))
    ex.render(64, 0)
    ex.show()
    sliders = ex.widget.children[0].children
    assert (sliders[0].value, sliders[1].value) == calls[-1] == (64, 0)
    plt.close("all")


def test_paging_beats_reservation_like_the_paper():
    """The lab-2 claim: reservation keeps 20.4-38.2% of memory as real state (PagedAttention), paging > 96%."""
    lens = workloads.lengths_sample(2000, seed=0, max_len=2048)
    contiguous = workloads.utilization(lens, workloads.reserved_slots_contiguous(lens, 2048))
    paged = workloads.utilization(lens, workloads.reserved_slots_paged(lens, 16))
    assert 0.18 < contiguous < 0.40 and paged > 0.96


def test_prefix_workloads_order_of_hit_rates():
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.prefix import make_prefix_cache

    rates = {}
    for name, prompts in [("system", workloads.system_prompt_workload()), ("multi", workloads.multi_turn_workload()),
                          ("rag", workloads.rag_workload())]:
        for kind in ("radix", "hash"):
            pool = BlockPool(1024)
            rates[name, kind] = workloads.hit_rate(
                workloads.replay_prefix_cache(make_prefix_cache(kind, pool, 16), pool, prompts))
        assert rates[name, "radix"] == rates[name, "hash"]
    assert rates["system", "radix"] > rates["multi", "radix"] > rates["rag", "radix"] > 0


def test_figures_script_draws_every_figure(tmp_path):
    """figures/ must be what the script draws today, byte for byte: the script promises identical reruns (seeded,
    no date stamp; matplotlib is pinned), so a figure that no longer matches shows the README and the labs a
    picture of an engine, a seed or a workload the code has moved away from."""
    import make_figures

    assert make_figures.main(["--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.glob("*.png")}
    assert names >= {"block_table.png", "radix_tree.png", "step_timeline.png", "fragmentation.png", "prefix_hit_rates.png"}
    committed = {p.name for p in (ROOT / "figures").glob("*.png")}
    assert names == committed, "figures/ is stale: run python tools/make_figures.py"
    stale = sorted(n for n in names if (tmp_path / n).read_bytes() != (ROOT / "figures" / n).read_bytes())
    assert not stale, f"figures/ {stale} differ from what tools/make_figures.py draws: run it"


def _cell_names(source: str) -> tuple[set[str], set[str]]:
    """(names a cell binds, names it reads before binding them) of one code cell, by its syntax tree (IPython's %/!
    lines dropped), statement by statement in source order, into loop, ``if``, ``with`` and ``try`` bodies:
    ``print(x); x = None`` and ``x += 1`` read ``x`` first (a review found the first version filed both as binds
    only); a loop's, comprehension's, ``with``'s or function's own names are bound before their bodies read them.
    A function body counts as read where it is defined (earlier than it runs: the safe side)."""
    tree = ast.parse("\n".join(line for line in source.split("\n") if not line.lstrip().startswith(("%", "!"))))
    binds, reads = set(), set()

    def simple(parts) -> None:  # expressions and simple statements: what they read first, then what they bind
        stored, loaded, local = set(), set(), set()  # local: bound inside before their own bodies read them
        for node in (n for part in parts for n in ast.walk(part)):
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                local.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                local.update(n.id for n in ast.walk(node.optional_vars) if isinstance(n, ast.Name))
            elif isinstance(node, ast.NamedExpr):
                local.add(node.target.id)
            elif isinstance(node, ast.arg):
                local.add(node.arg)
            if isinstance(node, ast.Name):
                (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                loaded.add(node.target.id)  # (its target is a Store that reads first)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stored.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                stored.update((a.asname or a.name).split(".")[0] for a in node.names)
        reads.update(loaded - binds - local)
        binds.update(stored)

    def block(statements) -> None:
        for st in statements:
            if not isinstance(st, (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)):
                simple([st])
                continue
            # the header (a loop's iterable and target, a test, a with's items) first, then each body in order
            simple([v for k, v in ast.iter_fields(st) if k not in ("body", "orelse", "finalbody", "handlers")
                    and isinstance(v, ast.AST)] + [i for i in getattr(st, "items", [])])
            block(st.body)
            for handler in getattr(st, "handlers", []):
                binds.update([handler.name] if handler.name else [])
                block(handler.body)
            block(getattr(st, "orelse", []))
            block(getattr(st, "finalbody", []))

    block(tree.body)
    return binds, reads


def test_a_student_run_that_skips_the_covered_cells_still_runs_and_labs_8_and_9_skip_their_simulations():
    """CI runs each lab twice, the solution under strict nbval and the student copy lax; a cell tagged
    ``covered-by-solution`` is skipped in the second.  CI reported lab 8 at 204-208 s, over the course's 180 s;
    more than half of its run is four simulations that read nothing a learner writes (the bill at scale, the
    fleet's scrape, the at-scale knee sweep, the tuning table), so its student copy skips them.  Lab 9 was CI's
    slowest student run (350 s under load): its capacity sweep (22 fleet simulations, 70% of the run), the
    re-simulation of six held-out runs and the profile check on this machine read nothing a learner writes
    either.  A skipped cell must bind nothing a later cell that runs reads, or the lax run would stop at a
    NameError.  Oracle: a recount of every student notebook's names by syntax tree (a name bound again by a
    running cell before it is read is fine), and, for labs 8 and 9, which cells call those simulations."""
    heavy = {"lab08": ("at_scale.knee_sweep(", "lab8.cost_run(", "lab8.fleet_scrape(", "lab8.tuning_table("),
             "lab09": ("sweep(study,", "resimulate(", "check(doc,")}
    for path in sorted(LABS.glob("lab*.ipynb")):
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        skipped = [make_labs.COVERED in c.metadata.get("tags", []) for c in cells]
        if path.name[:5] in heavy:
            calls = [any(h in c.source for h in heavy[path.name[:5]]) for c in cells]
            assert sum(calls) == len(heavy[path.name[:5]]) and skipped == calls, (path.name, skipped, calls)
        only_skipped: set[str] = set()  # bound by a skipped cell and not since by a running one
        for cell, skip in zip(cells, skipped):
            binds, reads = _cell_names(cell.source)
            if skip:
                only_skipped |= binds
                continue
            missing = reads & only_skipped  # (read before this cell binds it)
            assert not missing, f"{path.name}: a running cell reads {sorted(missing)}, bound only in a skipped cell"
            only_skipped -= binds


def test_a_cell_covered_by_the_solution_run_is_skipped_only_in_the_student_copy():
    """make_labs gives a cell tagged ``covered-by-solution`` nbval's skip tag in labs/ only (CI's strict run of
    solutions/ executes it), refuses the tag on a cell holding an exercise, and leaves every other cell's tags."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = simulate()"), nbformat.v4.new_code_cell("y = 1")]
    nb.cells[0].metadata["tags"] = [make_labs.COVERED]
    lab = make_labs.make_lab(nb)
    assert lab.cells[0].metadata["tags"] == [make_labs.COVERED, "nbval-skip"]
    assert "tags" not in lab.cells[1].metadata and nb.cells[0].metadata["tags"] == [make_labs.COVERED]
    nb.cells[1].source = "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n"
    nb.cells[1].metadata["tags"] = [make_labs.COVERED]
    with pytest.raises(make_labs.MarkerError, match="holds an exercise"):
        make_labs.make_lab(nb)
    for path in sorted((ROOT / "solutions").glob("lab*.ipynb")):  # the tag is used only where nothing is learner's
        for cell in nbformat.read(path, as_version=4).cells:
            if make_labs.COVERED in cell.metadata.get("tags", []):
                assert "### BEGIN SOLUTION" not in cell.source
