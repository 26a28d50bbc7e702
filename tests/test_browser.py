"""The labs' widgets and quizzes in a real browser: JupyterLab 4.6 + headless Chromium, default settings.

Why a browser test?  nbval runs every cell, but it never renders a widget:
the bug it could not see was that every *next step* redraw came out blank or
garbled in JupyterLab (button callbacks run on a kernel subshell thread there,
and pyplot's hooks redrew the same figure on the main one).  This test does
what a learner does: open each *student* notebook with a widget -- the copy in
``labs/``, exercises unsolved, whose stubs fall back to the engine -- *Run All*,
click the widget's buttons, and compare the picture's pixels between clicks.

Because Run All here runs every cell of those student notebooks top to bottom,
``tests/test_notebooks.py`` does not run them a second time under nbval-lax in
a session where this test runs them (it still does when Chromium is missing).

What it asserts, per notebook:

* every cell ran (no error output) and the widget shows one picture, not blank;
* each click of *next step* changes that picture, and the picture is still not
  blank -- so the widget's engine was not run to the end by the cells after it;
* the click did not add a second picture to the output (updated in place);
* the other buttons (*run to end*, ...) answer without an error in the log;
* the interactive quiz answers a click with feedback, and the page logs no
  JavaScript error (jupyterquiz must not try to fetch MathJax from a CDN).

Screenshots land in ``.artifacts/browser/``.  Needs Playwright for Python and
Debian's ``chromium`` (``tools/install_browser.sh``; Playwright's own browser
download is not used); without them the test skips and says which is missing.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / ".artifacts" / "browser"
CLICKS = 3  # "next step" clicks per widget
RUN_ALL_TIMEOUT_S = 420  # all notebooks together, from the first Run All
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")
DEFAULT_BUTTONS = ("next step", "run to end")


def _chromium() -> str | None:
    """Debian's Chromium binary (the real one, not the /usr/bin shell wrapper, when both exist)."""
    env = os.environ.get("MINIVLLM_CHROMIUM")
    for path in ([env] if env else []) + list(CHROMIUM_CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def _notebooks() -> list[tuple[Path, tuple[str, ...]]]:
    """Labs 1-3 and every registered lab that declares widgets: (student notebook, button labels)."""
    wanted: dict[str, tuple[str, ...]] = {}
    try:
        from minivllm.labs.registry import labs

        for lab in labs():
            if lab.widgets or lab.number <= 3:
                wanted[lab.stem] = tuple(lab.widgets) or DEFAULT_BUTTONS
    except Exception:  # noqa: BLE001 -- a broken registry must not hide the browser check of labs 1-3
        pass
    for path in sorted((ROOT / "labs").glob("lab0[123]_*.ipynb")):
        wanted.setdefault(path.stem, DEFAULT_BUTTONS)
    return [(ROOT / "labs" / f"{stem}.ipynb", labels) for stem, labels in sorted(wanted.items())
            if (ROOT / "labs" / f"{stem}.ipynb").exists()]


def _skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install -e '.[dev]')"
    if _chromium() is None:
        return "Chromium is not installed: run tools/install_browser.sh (Debian's chromium package)"
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        return "JupyterLab is not installed in this environment (pip install -e '.[dev]')"
    return None


needs_browser = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _picture_stats(png: bytes) -> tuple[int, float]:
    """(distinct colours, fraction of pixels that are not near-white) of a screenshot."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    return len(np.unique(rgb, axis=0)), float((rgb.min(axis=1) < 235).mean())


def _assert_not_blank(png: bytes, what: str) -> None:
    colours, inked = _picture_stats(png)
    assert colours >= 8 and inked > 0.01, f"{what}: picture looks blank ({colours} colours, {inked:.1%} inked)"


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, default settings, serving copies of the student notebooks.

    Copies, because JupyterLab autosaves what it runs.  The settings and
    workspace folders are fresh and empty, so a developer's own JupyterLab
    settings cannot change what is tested: the defaults (comms over subshells
    included) are what a new learner gets.
    """
    work = tmp_path_factory.mktemp("jupyter")
    notebooks = work / "notebooks"
    notebooks.mkdir()
    for path, _ in _notebooks():  # outputs and widget state cleared: what a learner opens
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nb.metadata.pop("widgets", None)
        nbformat.write(nb, notebooks / path.name)
    port, token = _free_port(), secrets.token_hex(16)
    # OMP_NUM_THREADS=1: the notebooks' kernels run side by side, and six kernels with a thread per core
    # each spin against one another on a 2-core machine (the whole check took 250 s that way, 140 s so).
    env = dict(os.environ, PYTHONHASHSEED="0", JUPYTERLAB_SETTINGS_DIR=str(work / "settings"), OMP_NUM_THREADS="1",
               JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"), JUPYTER_RUNTIME_DIR=str(work / "runtime"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebooks}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "jupyter.log", "w")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (work / "jupyter.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _accept_kernel_dialog(page, timeout_ms: int) -> None:
    """JupyterLab may ask which kernel to start (a race with its session start-up): take the default."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=timeout_ms)
    except PlaywrightTimeout:
        pass


def _start_run_all(page) -> None:
    """Wait for the notebook and its kernel, then Run > Run All Cells (what a learner clicks)."""
    page.bring_to_front()
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached", timeout=60_000)
    _accept_kernel_dialog(page, 3_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", state="attached", timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    _accept_kernel_dialog(page, 3_000)


PROMPTS_JS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim())"


def _wait_all_ran(page, timeout_s: float) -> list[str]:
    """Until Run All is over: every code cell shows an execution count, or the run stopped early -- no cell
    is queued or running (``[*]``) and some never ran (``[ ]``), which is what JupyterLab shows after a
    cell raised, whatever the error looks like.  Returns the cells' prompts, for the caller to judge."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            """() => {
                const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent);
                if (prompts.length === 0 || prompts.some(t => t.includes('[*]'))) return false;
                const ran = prompts.filter(t => /\\[\\d+\\]/.test(t)).length;
                return ran > 0;  // none queued or running: every cell ran, or the run stopped
            }""", timeout=max(1.0, timeout_s) * 1000, polling=500)
    except PlaywrightTimeout:
        status = page.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")
        raise AssertionError(f"Run All did not end within {timeout_s:.0f} s; kernel {status}; "
                             f"prompts: {page.evaluate(PROMPTS_JS)}") from None
    return page.evaluate(PROMPTS_JS)


@pytest.fixture(scope="module")
def opened(jupyter, browser, request):
    """Every notebook open in its own tab, *Run All* started in all of them at once.

    The kernels run side by side (the notebooks are independent), so the
    whole check takes about as long as the slowest notebook, not the sum.
    """
    url, token = jupyter
    selected = {item.callspec.params["path"] for item in request.session.items
                if item.originalname == "test_widgets_and_quiz_work_in_jupyterlab"}
    tabs = {}
    t0 = time.time()
    for path, _ in _notebooks():
        if path not in selected:
            continue
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc, errors=errors: errors.append(str(exc)))
        # one workspace per tab: each tab shows only its notebook, and no two tabs autosave the same file
        page.goto(f"{url}/lab/workspaces/{path.stem}/tree/{path.name}?reset&token={token}")
        page.add_style_tag(content=".Toastify { display: none !important; }")  # the news toast hides pictures
        tabs[path.stem] = (page, errors)
    for page, _ in tabs.values():
        _start_run_all(page)
    yield tabs, t0
    for page, _ in tabs.values():
        page.close()


def _keep_screenshot(target, name: str) -> None:
    """Save a screenshot under ``.artifacts/browser/`` for a person to look at, if the browser can take one.

    These pictures are evidence for a reader, not something the test asserts on (the
    pictures it compares come from ``_picture``).  Taking one waits for the page to
    render; on a CI machine whose two cores are busy with the other notebooks' kernels
    that wait once ran past Playwright's 30 s and failed a test whose checks had all
    passed -- so a capture that cannot be taken is reported and skipped, never fatal.
    """
    from playwright.sync_api import Error as PlaywrightError

    try:
        target.screenshot(path=str(ARTIFACTS / name))
    except PlaywrightError as exc:  # shown in pytest's warnings summary
        warnings.warn(f"screenshot {name} not saved: {str(exc).splitlines()[0]}", stacklevel=2)


def _picture(widget) -> bytes:
    img = widget.locator("img").first
    img.scroll_into_view_if_needed()
    # (60 s, not Playwright's 30: the renderer shares two cores with every notebook's kernel, and a capture that
    # waits on it is not what this test judges -- the picture's pixels are)
    return img.screenshot(animations="disabled", timeout=60_000)


def _log_text(widget) -> str:
    """The text log under a widget's picture (empty for widgets without one)."""
    logs = widget.locator(".widget-html")
    return logs.last.inner_text() if logs.count() else ""


def _wait_changed(widget, before: bytes, what: str, timeout_s: float = 30) -> bytes:
    deadline = time.time() + timeout_s
    while True:
        now = _picture(widget)
        if now != before:
            return now
        assert time.time() < deadline, \
            f"{what}: the picture did not change within {timeout_s:.0f} s of the click; log:\n{_log_text(widget)}"
        time.sleep(0.3)


@pytest.mark.slow  # the notebooks load the bundled model
@needs_browser
@pytest.mark.parametrize("path,labels", [pytest.param(p, b, id=p.stem) for p, b in _notebooks()])
def test_widgets_and_quiz_work_in_jupyterlab(opened, path, labels):
    tabs, t0 = opened
    stem = path.stem
    page, errors = tabs[stem]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.bring_to_front()
    try:
        prompts = _wait_all_ran(page, t0 + RUN_ALL_TIMEOUT_S - time.time())
        print(f"{stem}: Run All ended {time.time() - t0:.0f} s after the first one")
        failed = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                              has_text="Traceback")
        assert failed.count() == 0, f"{stem}: a cell failed: {failed.first.text_content()[:2000]}"
        never = [i for i, t in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:?", t)]
        if never:  # stopped at an error without a traceback (a SyntaxError, say): show the last cell that ran
            last = page.locator(".jp-CodeCell").nth(never[0] - 1)
            raise AssertionError(f"{stem}: Run All stopped; code cells {never[0] + 1}-{len(prompts)} (from 1) never ran; the last one "
                                 f"that did printed:\n{last.locator('.jp-OutputArea').text_content()[:2000]}")

        first = labels[0]
        buttons = page.locator("button.widget-button", has_text=first)
        assert buttons.count() >= 1, f"{stem}: no '{first}' button rendered (widgets did not load)"
        for w in range(buttons.count()):
            button = buttons.nth(w)
            widget = button.locator("xpath=ancestor::div[contains(@class,'widget-vbox')][last()]")
            cell = button.locator("xpath=ancestor::div[contains(@class,'jp-Cell')][1]")
            outputs = cell.locator(".jp-OutputArea-output").count()
            assert widget.locator("img").count() == 1, f"{stem}: widget {w} should show exactly one picture"
            png = _picture(widget)
            _assert_not_blank(png, f"{stem} widget {w} before any click")
            (ARTIFACTS / f"{stem}-w{w}-0.png").write_bytes(png)
            for k in range(1, CLICKS + 1):
                button.click()
                png = _wait_changed(widget, png, f"{stem} widget {w}, click {k} of '{first}'")
                _assert_not_blank(png, f"{stem} widget {w} after click {k}")
                (ARTIFACTS / f"{stem}-w{w}-{k}.png").write_bytes(png)
            _keep_screenshot(widget, f"{stem}-widget{w}.png")  # mid-run: controls, picture, log
            log = _log_text(widget)
            assert "no work left" not in log, f"{stem}: the widget's engine was already finished:\n{log}"
            for other in labels[1:]:
                widget.locator("button.widget-button", has_text=other).first.click()
                page.wait_for_timeout(1500)
                png = _picture(widget)
                _assert_not_blank(png, f"{stem} widget {w} after '{other}'")
                log = _log_text(widget)
                assert "Error" not in log, f"{stem}: '{other}' failed:\n{log}"
            assert cell.locator(".jp-OutputArea-output").count() == outputs, \
                f"{stem}: clicking added outputs (a second picture) instead of updating the one picture"

        if "show_quiz(" in path.read_text():
            answers = page.locator(".MCButton")
            assert answers.count() > 0, f"{stem}: the interactive quiz did not render"
            answers.first.scroll_into_view_if_needed()
            answers.first.click()
            feedback = page.locator(".Feedback.correct, .Feedback.incorrect").first
            feedback.wait_for(timeout=10_000)
            assert feedback.inner_text().strip(), f"{stem}: a quiz answer gave no feedback"
            _keep_screenshot(page.locator(".Quiz").first, f"{stem}-quiz.png")
        assert not errors, f"{stem}: the page logged JavaScript errors: {errors[:3]}"
    finally:
        _keep_screenshot(page, f"{stem}-page.png")


# -- what the browser relies on, checked without one (fast) ------------------------------------


def test_a_screenshot_the_browser_cannot_take_is_a_warning_not_a_failure():
    """The artifact pictures are for people; a busy renderer that times out must not fail a passing check."""
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    class Busy:
        def screenshot(self, path):
            raise PlaywrightTimeout("Page.screenshot: Timeout 30000ms exceeded.\nCall log:\n  - taking page screenshot")

    with pytest.warns(UserWarning, match=r"lab03-page\.png not saved: Page\.screenshot: Timeout 30000ms exceeded\.$"):
        _keep_screenshot(Busy(), "lab03-page.png")


def _engine(n=5, seed=7):
    from minivllm import SamplingParams
    from minivllm.labs import workloads

    eng = workloads.sim_engine(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, model_max_len=96)
    for i, (prompt, m) in enumerate(workloads.random_requests(n, seed=seed, prompt_range=(6, 30),
                                                              output_range=(4, 20))):
        eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=m, ignore_eos=True), f"r{i}")
    return eng


def test_stepper_draws_off_pyplot_and_updates_one_picture():
    """Clicks redraw the widget's own Figure: pyplot never sees a figure, the picture changes, the widget's
    engine advances one step per click and nothing else does."""
    pytest.importorskip("ipywidgets")
    import matplotlib.pyplot as plt

    from minivllm.labs import widgets

    plt.close("all")
    eng = _engine()
    stepper = widgets.Stepper(eng, draw=lambda e, ax: widgets.draw_block_pool(e.pool, widgets.block_owners(e), ax=ax),
                              describe=lambda e: f"step {len(e.step_log)}")
    stepper.show()
    image = stepper.image
    first = image.value
    _assert_not_blank(first, "before a click")
    for k in range(1, 4):
        stepper.press("next step")
        assert len(eng.step_log) == k
        assert stepper.image is image and image.value != first, "the one Image must be updated in place"
        _assert_not_blank(image.value, f"after click {k}")
        first = image.value
    assert plt.get_fignums() == [], "a widget drew on a pyplot figure"
    assert "step 3" in stepper.log.value
    stepper.press("run to end")
    assert not eng.has_unfinished_requests()


def test_request_colour_is_stable_while_others_finish():
    """Oracle: the face colour of each request's blocks, read back from the drawn patches at every step,
    is one colour per request over the whole run (even as earlier requests finish and leave the list)."""
    from matplotlib.figure import Figure

    from minivllm.labs import widgets
    from tests.invariants import steps

    eng = _engine(n=6, seed=3)
    seen: dict[str, set] = {}
    finished_while_others_ran = False
    for _ in steps(eng):
        owners = widgets.block_owners(eng)
        if owners and len(owners) < len(seen):
            finished_while_others_ran = True
        ax = Figure().add_subplot()
        widgets.draw_block_pool(eng.pool, owners, ax=ax)
        faces = {round(p.get_x()) + 16 * round(-p.get_y()): tuple(p.get_facecolor()[:3])
                 for p in ax.patches if p.get_width() > 0.5 and p.axes is ax}
        for rid, table in owners.items():
            seen.setdefault(rid, set()).update(faces[b] for b in table)
    assert finished_while_others_ran, "the workload should have requests finish while others run"
    assert all(len(c) == 1 for c in seen.values()), {r: len(c) for r, c in seen.items()}
    assert len({next(iter(c)) for c in seen.values()}) == len(seen), "two requests drawn in one colour"


def test_radix_tree_boxes_name_the_shared_tokens():
    """Each box shows the token positions and ids its edge stores (read from the cache), not block ids."""
    from matplotlib.figure import Figure

    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.prefix.radix import RadixCache
    from minivllm.labs import widgets, workloads

    pool = BlockPool(256)
    cache = RadixCache(pool, 16)
    chats = workloads.shared_system_chats(3, 3, seed=2, system_len=48)
    replay = workloads.PrefixReplay(cache, pool, chats)
    for _ in range(5):
        replay.step()
    ax = Figure().add_subplot()
    widgets.draw_radix_tree(cache, ax=ax)
    texts = [t.get_text() for t in ax.texts]
    system = chats[0][:48]
    assert any(t.startswith(f"tok 0-47: {system[0]} {system[1]} {system[2]} … {system[47]}") for t in texts), texts
    assert not any("blk [" in t for t in texts)
