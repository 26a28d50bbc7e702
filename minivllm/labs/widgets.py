"""Pictures of the engine's state, drawn from the real objects, with step-through controls.

Three views, reusable across labs:

* :func:`draw_block_pool` -- every KV block as a cell, coloured by the request
  that holds it; a number shows the refcount where a block is shared; cached
  blocks nobody uses are hatched; free blocks are blank.
* :func:`draw_radix_tree` -- a :class:`~minivllm.kv.prefix.radix.RadixCache`'s
  trees: one box per node labelled with the tokens it shares, locked nodes (a
  running request holds their blocks) outlined, and the LRU clock of each node.
* :func:`draw_timeline` -- one row per request, one column per engine step:
  prefill chunks vs decode tokens, with TTFT and ITL read off the same log.

Every interactive view here (:class:`Stepper`, :class:`TierStepper`,
:class:`BudgetExplorer`, and the labs' own, bar :class:`~minivllm.labs.live.LiveLoad`,
which keeps its own Figure and Image the same way) is a :class:`PictureWidget`: one
:class:`matplotlib.figure.Figure` the widget owns, rendered to PNG bytes and
shown in one ``ipywidgets.Image`` that each click updates in place.  Why not
pyplot?  JupyterLab 4.6 delivers widget messages on a kernel *subshell*
(``commsOverSubshells``), so a button callback runs on another thread than
the cell code; pyplot's post-execute hooks then redraw "the current figure"
on the main thread while the callback draws on it, and the picture comes out
blank or garbled.  A Figure pyplot never heard of has no such second writer.
A request's colour is a function of its id (:func:`request_colour`), never of
its position in a list, so it does not change when another request finishes.

Why both a static picture and a widget?  Widgets need a live kernel; GitHub,
nbval and HTML exports have none.  So each widget's output carries the same
PNG as a static fallback plus one stable text line (nbval compares text).
"""

from __future__ import annotations

import hashlib
import html
import re
import threading
from typing import Any, Callable, Sequence

import matplotlib
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from minivllm.metrics.stats import nearest_rank
from minivllm.metrics.step_log import decode_flags

PALETTE = matplotlib.colormaps["tab20"].colors


def _colour(i: int):
    """The ``i``-th colour: the ten strong tab20 colours first, then their light partners.

    tab20 comes in strong/light pairs; in palette order requests 0 and 1 would get two shades of one hue,
    hard to tell apart in a small cell, so the first ten requests (most pictures have no more) get ten hues."""
    i %= 20
    return PALETTE[2 * i] if i < 10 else PALETTE[2 * (i - 10) + 1]


def colour_index(request_id: Any) -> int:
    """A stable palette index for a request id: its trailing number (``r7`` -> 7), a trailing lone letter's
    place in the alphabet (``C``, ``req C`` -> 2), else a hash of the id -- never its position in some list."""
    name = str(request_id)
    m = re.search(r"(\d+)$", name)
    if m:
        return int(m.group(1))
    m = re.search(r"(?:^|[\s_-])([A-Za-z])$", name)
    if m:
        return ord(m.group(1).upper()) - ord("A")
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")


def request_colour(request_id: Any):
    """The colour of ``request_id`` in every picture, at every step."""
    return _colour(colour_index(request_id))


def _pyplot_axes(figsize):
    """A fresh pyplot figure for a *static* cell (``draw_x(...); plt.show()``); widgets never come here."""
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)[1]


# -- block pool ---------------------------------------------------------------------


def block_owners(engine) -> dict[str, list[int]]:
    """``{request_id: block table}`` of every request holding blocks, in admission order."""
    return {r.request_id: list(r.block_ids) for r in engine.scheduler.running if r.block_ids}


def draw_block_pool(pool, tables: dict[str, Sequence[int]], *, cache: Any = None, cols: int = 16,
                    title: str | None = None, ax=None):
    """Draw ``pool``'s blocks; ``tables`` maps an owner name to its block table.

    A block in several tables is drawn in the first owner's colour with its
    refcount written on it, so sharing is visible at a glance.  Colours come
    from the owner names (:func:`request_colour`), so they stay put across steps.
    """
    n = pool.num_blocks
    rows = -(-n // cols)
    if ax is None:
        ax = _pyplot_axes((min(12, 0.55 * cols + 2.5), 0.55 * rows + 0.9))
    owner_of: dict[int, str] = {}
    names = list(tables)
    for name in names:
        for b in tables[name]:
            owner_of.setdefault(b, name)
    for b in range(n):
        r, c = divmod(b, cols)
        rc = pool.refcount(b)
        cached = cache is not None and cache.is_cached(b)
        if b in owner_of:
            face, hatch = request_colour(owner_of[b]), None
        elif cached:
            face, hatch = "#eeeeee", "///"
        else:
            face, hatch = "white", None
        ax.add_patch(Rectangle((c, -r), 0.92, 0.92, facecolor=face, edgecolor="#555555", hatch=hatch, lw=0.8))
        label = str(b)
        if rc > 1:
            label += f"\n×{rc}"
        ax.text(c + 0.46, -r + 0.46, label, ha="center", va="center", fontsize=7)
    handles = [Rectangle((0, 0), 1, 1, facecolor=request_colour(name)) for name in names]
    labels = list(names)
    if cache is not None:
        handles.append(Rectangle((0, 0), 1, 1, facecolor="#eeeeee", hatch="///"))
        labels.append("cached, unused")
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#555555"))
    labels.append("free")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-rows + 0.9, 1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"block pool: {pool.num_free} of {n} free  (×k = refcount)", fontsize=10)
    return ax


def describe_block_pool(pool, tables: dict[str, Sequence[int]]) -> str:
    """The text fallback of :func:`draw_block_pool`."""
    lines = [f"{pool.num_free}/{pool.num_blocks} blocks free"]
    for name, table in tables.items():
        shared = [b for b in table if pool.refcount(b) > 1]
        lines.append(f"  {name}: {list(table)}" + (f"  shared: {shared}" if shared else ""))
    return "\n".join(lines)


# -- step timeline -------------------------------------------------------------------


def timeline_rows(step_log: Sequence[dict], prompt_lens: dict[str, int]) -> dict[str, list[tuple[int, str, int]]]:
    """``{request_id: [(step, 'prefill'|'decode', num_tokens), ...]}`` from ``engine.step_log``."""
    rows: dict[str, list[tuple[int, str, int]]] = {}
    for entry in step_log:
        for (rid, _, num), decode in zip(entry["seqs"], decode_flags(entry, prompt_lens)):
            rows.setdefault(rid, []).append((entry["step"], "decode" if decode else "prefill", num))
    return rows


def step_composition(seqs: Sequence[tuple[str, int, int]], prompt_lens: dict[str, int],
                     num_decodes: int | None = None) -> tuple[int, int]:
    """``(prefill tokens, decode tokens)`` of one step-log entry's ``seqs``: how the timeline colours a step.

    ``num_decodes`` is the entry's own count of its leading decode rows (``record.num_decodes``), when known."""
    rows = timeline_rows([{"step": 0, "seqs": seqs, "num_decodes": num_decodes}], prompt_lens)
    prefill = sum(n for r in rows.values() for _, kind, n in r if kind == "prefill")
    decode = sum(n for r in rows.values() for _, kind, n in r if kind == "decode")
    return prefill, decode


def draw_timeline(step_log: Sequence[dict], prompt_lens: dict[str, int], *, ax=None, title: str | None = None,
                  annotate: bool = True):
    """One row per request, one column per step: orange = prefill chunk (tokens written), blue = decode."""
    rows = timeline_rows(step_log, prompt_lens)
    names = sorted(rows, key=lambda r: min(s for s, _, _ in rows[r]))
    steps = len(step_log)
    if ax is None:
        ax = _pyplot_axes((min(12, 2 + 0.28 * steps), 0.9 + 0.35 * len(names)))
    for y, rid in enumerate(names):
        for step, kind, num in rows[rid]:
            colour = "#f28e2b" if kind == "prefill" else "#4e79a7"
            ax.add_patch(Rectangle((step, -y - 0.4), 0.95, 0.8, color=colour))
            if annotate and kind == "prefill":
                ax.text(step + 0.47, -y, str(num), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([-y for y in range(len(names))], names, fontsize=8)
    first = step_log[0]["step"] if steps else 0  # a wrapped (ring-buffer) log starts past step 0
    ax.set_xlim(first, max(step_log[-1]["step"] + 1 if steps else 0, first + 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-len(names) + 0.4, 0.6)
    ax.set_xlabel("engine step")
    ax.legend([Rectangle((0, 0), 1, 1, color="#f28e2b"), Rectangle((0, 0), 1, 1, color="#4e79a7")],
              ["prefill chunk (tokens)", "decode (1 token)"], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize=8, frameon=False)
    ax.set_title(title or "step timeline", fontsize=10)
    return ax


def describe_step(entry: dict, prompt_lens: dict[str, int]) -> str:
    """One line per step: who ran, prefill or decode, how many tokens."""
    parts = []
    for (rid, start, num), decode in zip(entry["seqs"], decode_flags(entry, prompt_lens)):
        kind = "decode" if decode else f"prefill[{start}:{start + num}]"
        parts.append(f"{rid} {kind}")
    extra = f"  preempted: {entry['preempted']}" if entry["preempted"] else ""
    return f"step {entry['step']:3d}: {entry['num_tokens']:4d} tokens | " + ", ".join(parts) + extra


# -- radix tree ------------------------------------------------------------------------


def radix_nodes(cache) -> list[dict]:
    """Flatten a RadixCache into ``[{id, parent, depth, start, tokens, blocks, locked, last_access, namespace}]``.

    ``tokens`` are the token ids the node's edge stores (what every request
    passing through it shares) and ``start`` their position in the prompt.
    """
    out: list[dict] = []

    def visit(node, parent_id, depth, start):
        nid = len(out)
        tokens = [t for block in node.token_blocks for t in block]
        out.append({"id": nid, "parent": parent_id, "depth": depth, "start": start, "tokens": tokens,
                    "blocks": list(node.block_ids),
                    "locked": [b for b in node.block_ids if cache.pool.refcount(b) > 1],
                    "last_access": node.last_access, "namespace": node.namespace,
                    "first_tokens": node.token_blocks[0][:3] if node.token_blocks else ()})
        for key in sorted(node.children, key=lambda k: k):
            visit(node.children[key], nid, depth + 1, start + len(tokens))

    for _, root in cache.roots():
        visit(root, None, 0, 0)
    return out


def namespace_label(namespace) -> str:
    """A readable name for a cache namespace: the engine's ``(tenant, salt)`` tuple, or anything else."""
    if isinstance(namespace, tuple) and len(namespace) == 2:
        tenant, salt = namespace
        parts = ([f"tenant={tenant}"] if tenant is not None else ["shared"]) + ([f"salt={salt}"] if salt else [])
        return ", ".join(parts)
    return repr(namespace) if namespace not in ((), "", None) else "public"


def token_span(node: dict, detokenize: Callable[[Sequence[int]], str] | None = None, width: int = 3) -> str:
    """The tokens a radix node shares, short: ``"48-63: 812 33 901 … 14"`` (or text via ``detokenize``)."""
    toks = node["tokens"]
    if not toks:
        return "(empty)"
    where = f"{node['start']}-{node['start'] + len(toks) - 1}"
    if detokenize is not None:
        text = detokenize(toks).replace("\n", " ")
        return f"{where}: {text[:18] + '…' if len(text) > 19 else text!r}"
    shown = " ".join(map(str, toks[:width])) + (f" … {toks[-1]}" if len(toks) > width else "")
    return f"{where}: {shown}"


def describe_radix_tree(cache) -> str:
    """Indented text version of :func:`draw_radix_tree`: tokens shared per node, its blocks, clock, locks."""
    lines = []
    for n in radix_nodes(cache):
        if n["parent"] is None:
            lines.append(f"root[{namespace_label(n['namespace'])}]")
            continue
        lock = f" locked={n['locked']}" if n["locked"] else ""
        lines.append("  " * n["depth"] + f"└ tokens {token_span(n)} | blocks {n['blocks']} "
                     f"(t={n['last_access']}){lock}")
    return "\n".join(lines)


def draw_radix_tree(cache, *, ax=None, title: str | None = None,
                    detokenize: Callable[[Sequence[int]], str] | None = None):
    """One box per node, labelled with the tokens it shares (positions and first ids, or text with
    ``detokenize``) and its block count; edges to children; red outline = locked by a running request."""
    nodes = radix_nodes(cache)
    # x position: leaves left to right, parents centred over children
    children: dict[int, list[int]] = {}
    for n in nodes:
        if n["parent"] is not None:
            children.setdefault(n["parent"], []).append(n["id"])
    xs: dict[int, float] = {}
    next_x = [0.0]

    def place(i):
        kids = children.get(i, [])
        if not kids:
            xs[i] = next_x[0]
            next_x[0] += 1
        else:
            for k in kids:
                place(k)
            xs[i] = sum(xs[k] for k in kids) / len(kids)

    for n in nodes:
        if n["parent"] is None:
            place(n["id"])
            next_x[0] += 0.5
    depth = max((n["depth"] for n in nodes), default=0)
    if ax is None:
        ax = _pyplot_axes((min(12, 1.6 + 1.7 * max(next_x[0], 1)), 1.2 + 1.1 * depth))
    for n in nodes:
        x, y = xs[n["id"]], -n["depth"]
        if n["parent"] is not None:
            ax.plot([xs[n["parent"]], x], [-n["depth"] + 1 - 0.2, y + 0.2], color="#888888", lw=1, zorder=1)
        if n["parent"] is None:
            label = f"root {namespace_label(n['namespace'])}"
            ax.text(x, y, label, ha="center", va="center", fontsize=8,
                    bbox=dict(boxstyle="round", fc="#dddddd", ec="#555555"))
            continue
        nb = len(n["blocks"])
        label = (f"tok {token_span(n, detokenize)}\n"
                 f"{nb} block{'s' if nb != 1 else ''} · t={n['last_access']}")
        ec = "#d62728" if n["locked"] else "#555555"
        ax.text(x, y, label, ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", fc="#e8f1fa", ec=ec, lw=2 if n["locked"] else 1))
    ax.set_xlim(-0.8, max(next_x[0] - 0.5, 1) + 0.3)
    ax.set_ylim(-depth - 0.6, 0.6)
    ax.axis("off")
    ax.set_title(title or f"radix tree: {cache.num_cached_blocks} cached blocks; a box = the tokens (positions: "
                 f"first ids) its requests share; red = locked (in use), t = last access", fontsize=9)
    return ax


# -- one pattern for every interactive view -----------------------------------------------


def _failure(label: str, exc: Exception) -> str:
    """The log line of a control whose callback raised."""
    return f"{label}: {type(exc).__name__}: {exc}"


def attempt(label: str, action: Callable[[], str]) -> str:
    """The line of text ``action`` returns, or, if it raised, the line that says what went wrong.

    A control's callback runs outside any cell: an exception raised from it reaches only the kernel's log,
    where a learner never looks.  Every control's action runs through here (:meth:`PictureWidget.handle`,
    :class:`~minivllm.labs.live.LiveLoad`'s button), and its widget shows the line it gets back.
    """
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 -- a click must tell the learner what went wrong
        return _failure(label, exc)


def figure_png(fig) -> bytes:
    """PNG bytes of a Figure the caller owns (no pyplot state involved)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


class PictureWidget:
    """One picture of live state, redrawn in place, with controls: the base of every widget here.

    Subclasses implement :meth:`paint` (draw the current state on the Figure
    they are handed) and :meth:`actions` (``[(button label, callable)]``; the
    callable changes the state and returns a line of text for the log) or
    override :meth:`controls` for other inputs (sliders).  What this class
    guarantees, and why:

    * one :class:`~matplotlib.figure.Figure` per widget, never pyplot's: the
      button callback may run on a kernel subshell thread while pyplot's hooks
      run on the main one (see the module docstring);
    * one ``ipywidgets.Image`` whose ``value`` each click replaces: a single
      picture updated in place, not a new one appended under the buttons;
    * the state a widget steps belongs to it alone: give it its own engine, so
      the cells after it (run by *Run All* before anyone clicks) cannot
      consume the steps the learner wants to watch;
    * clicks are serialised by a lock, and an exception in a callback is
      written to the widget's log instead of vanishing into the kernel log
      (:meth:`handle`, which a subclass's own controls call too).
    """

    caption = "[interactive picture: run this notebook in Jupyter to use the controls]"
    log_lines = 6

    def __init__(self, figsize=(11, 3.2)) -> None:
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=figsize)
        self.widget = None
        self.image = None
        self.log = None
        self._lines: list[str] = []
        self._lock = threading.Lock()

    # what a subclass provides
    def paint(self, fig) -> None:
        raise NotImplementedError

    def actions(self) -> list[tuple[str, Callable[[], str]]]:
        return []

    # the shared mechanics
    def png(self) -> bytes:
        """Redraw the current state on this widget's Figure; its PNG bytes."""
        self.fig.clear()
        self.paint(self.fig)
        return figure_png(self.fig)

    def note(self, text: str) -> None:
        """Add lines to the log under the picture (the last :attr:`log_lines` stay visible)."""
        self._lines = (self._lines + [ln for ln in text.splitlines() if ln])[-self.log_lines:]
        if self.log is not None:
            self.log.value = "<pre style='margin:0;font-size:11px;line-height:1.3'>" + html.escape(
                "\n".join(self._lines)) + "</pre>"

    def refresh(self, text: str = "") -> None:
        """Log ``text`` and replace the picture's bytes (the Image stays the same object)."""
        if text:
            self.note(text)
        if self.image is not None:
            self.image.value = self.png()

    def press(self, label: str) -> str:
        """Do what the button ``label`` does, then redraw: the click handler, callable without a browser."""
        return self.handle(label, lambda: dict(self.actions())[label]())

    def handle(self, label: str, action: Callable[[], str], *, redraw: bool = True) -> str:
        """Run one control's ``action`` under the click lock, log the line it returns, then redraw.

        Every control's callback goes through here (buttons by :meth:`press`, sliders and menus from their
        :meth:`controls`), so that an exception -- in the action, or in the redraw, which runs the widget's
        own drawing or simulation -- becomes a line in the log: raised from a callback, it would only reach
        the kernel's log, where a learner never looks.  ``redraw=False``: the action draws the picture itself.
        """
        with self._lock:
            text = attempt(label, action)
            try:
                if redraw:
                    self.refresh(text)
                else:
                    self.note(text)
            except Exception as exc:  # noqa: BLE001 -- so must a redraw that fails
                text = _failure(label, exc)
                self.note(text)
        return text

    def controls(self, w) -> list:
        """The input widgets above the picture (default: one button per action)."""
        buttons = []
        for label, _ in self.actions():
            button = w.Button(description=label)
            button.on_click(lambda _b, label=label: self.press(label))
            buttons.append(button)
        return [w.HBox(buttons)]

    def show(self) -> None:
        """Display the controls, the picture and the log; without ipywidgets, the picture alone."""
        from IPython.display import display

        png = self.png()
        try:
            import ipywidgets as w
        except ImportError:  # static picture only
            from IPython.display import Image

            display(Image(data=png))
            return None
        self.image = w.Image(value=png, format="png")
        self.log = w.HTML(value="", layout={"max_height": "9em", "overflow": "auto"})
        self.note("")
        self.widget = _PictureControls(self.controls(w) + [self.image, self.log], png, self.caption)
        display(self.widget)
        return None


# -- step-through control ----------------------------------------------------------------


class Stepper(PictureWidget):
    """"next step" / "run to end" buttons around a live engine, redrawing one view each time.

    ``draw(engine, ax)`` draws the view on an Axes of this widget's Figure;
    ``describe(engine)`` gives the log line of a step.  ``engine`` is anything
    with ``step()`` and ``has_unfinished_requests()`` (an ``LLMEngine``, a
    :class:`~minivllm.labs.workloads.PrefixReplay`); it should be the widget's
    own, not one later cells also run.  ``stop(engine)``, when given, ends a
    multi-step run early.
    """

    caption = "[step controls: run this notebook in Jupyter to click through the steps]"

    def __init__(self, engine, draw: Callable[[Any, Any], Any], describe: Callable[[Any], str],
                 figsize=(11, 3.2), stop: Callable[[Any], bool] | None = None) -> None:
        super().__init__(figsize)
        self.engine = engine
        self.draw = draw
        self.describe = describe
        self.stop = stop
        self.steps_taken = 0

    def paint(self, fig) -> None:
        ax = fig.add_subplot()
        self.draw(self.engine, ax)
        caption_h = 0.25 / fig.get_figheight()  # a strip at the bottom for where we are
        fig.tight_layout(rect=(0, caption_h, 1, 1))
        fig.text(0.005, 0.01, self.position(), fontsize=8, color="#444444", ha="left", va="bottom")

    def position(self) -> str:
        """Where the engine is, written under the picture: a step can leave the view itself unchanged (a decode
        that stays inside its block), and a click must still visibly do something."""
        engine = self.engine
        if hasattr(engine, "step_log"):  # a ring buffer: its length stops growing once it drops old steps
            n = engine.step_log[-1]["step"] + 1 if len(engine.step_log) else 0
        elif hasattr(engine, "records"):
            n = len(engine.records)
        else:
            n = self.steps_taken
        done = "" if engine.has_unfinished_requests() else " -- no work left"
        return f"steps run: {n}" + done  # a count; the log numbers steps from 0

    def step(self, n: int = 1, until: Callable[[Any], bool] | None = None) -> str:
        """Run up to ``n`` steps (fewer when the work runs out, or ``stop`` or this call's own ``until`` says so);
        one line per step.  Every control steps through here, so that each one honours ``stop``."""
        lines = []
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                lines.append("no work left")
                break
            self.engine.step()
            self.steps_taken += 1
            lines.append(self.describe(self.engine))
            if (self.stop is not None and self.stop(self.engine)) or (until is not None and until(self.engine)):
                break
        return "\n".join(lines)

    def actions(self):
        return [("next step", lambda: self.step(1)),
                ("run to end", lambda: "\n".join(self.step(10_000).splitlines()[-2:]))]


try:
    import ipywidgets as _w

    class _PictureControls(_w.VBox):
        """A VBox of controls whose static fallback (no live kernel) is the picture itself (PNG) plus one stable line."""

        def __init__(self, children, png: bytes, caption: str):
            super().__init__(children)
            self._png = png
            self._caption = caption

        def _repr_mimebundle_(self, **kwargs):
            import base64

            bundle = super()._repr_mimebundle_(**kwargs)
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            bundle = dict(bundle or {})
            if self._png:
                bundle["image/png"] = base64.b64encode(self._png).decode("ascii")
            bundle["text/plain"] = self._caption
            return bundle

    class _Controls(_PictureControls):
        """Controls without a picture of their own: the stable text line only."""

        def __init__(self, children):
            super().__init__(children, b"", Stepper.caption)

except ImportError:  # pragma: no cover
    _PictureControls = _Controls = None  # type: ignore[assignment,misc]


# -- two tiers: the device pool and the host (swap) tier (lab 5) --------------------------


def tier_owners(engine) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """``({request_id: device blocks}, {request_id: host blocks})`` of every request in the engine."""
    sched = engine.scheduler
    live = list(sched.running) + list(sched.waiting)
    device = {r.request_id: list(r.block_ids) for r in live if r.block_ids}
    host = {r.request_id: list(r.cpu_block_ids) for r in live if r.cpu_block_ids}
    return device, host


def draw_kv_tiers(engine, fig=None, *, colours: dict[str, int] | None = None, cols: int = 12,
                  title: str | None = None):
    """The device block pool (left) and the host tier (right) on one figure, coloured by request.

    A request parked in the host tier (status SWAPPED) has its colour on the
    right and none on the left; after a swap-in it is back on the left.  The
    title counts what moved in the last step.  ``fig`` is a
    :class:`matplotlib.figure.Figure` the caller owns (a new one if None).
    A request's colour comes from its id (:func:`request_colour`); ``colours``
    only remembers the order requests were first seen in, for the legend.
    """
    from matplotlib.figure import Figure

    device, host = tier_owners(engine)
    colours = {} if colours is None else colours
    for rid in list(device) + list(host):
        colours.setdefault(rid, len(colours))  # legend order only
    gpu, cpu = engine.kv.pool, engine.kv.cpu_pool
    if fig is None:
        fig = Figure(figsize=(11, 2.6))
    fig.clear()
    ax_gpu, ax_cpu = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    for ax, pool, tables, name in ((ax_gpu, gpu, device, "device (GPU) pool"), (ax_cpu, cpu, host, "host (CPU) tier")):
        n = pool.num_blocks if pool is not None else 0
        ncols = min(cols, max(n, 1))
        rows = max(1, -(-n // ncols))
        owner = {b: rid for rid, t in tables.items() for b in t}
        for b in range(n):
            r, c = divmod(b, ncols)
            rid = owner.get(b)
            face = request_colour(rid) if rid is not None else "white"
            ax.add_patch(Rectangle((c, -r), 0.92, 0.92, facecolor=face, edgecolor="#555555", lw=0.8))
            ax.text(c + 0.46, -r + 0.46, str(b), ha="center", va="center", fontsize=6)
        ax.set_xlim(-0.1, ncols)
        ax.set_ylim(-rows + 0.9, 1.05)
        ax.set_aspect("equal")
        ax.axis("off")
        free = pool.num_free if pool is not None else 0
        ax.set_title(f"{name}: {free}/{n} free", fontsize=9)
    names = sorted(colours, key=colours.get)
    shown = [rid for rid in names if rid in device or rid in host]
    handles = [Rectangle((0, 0), 1, 1, facecolor=request_colour(r)) for r in shown]
    labels = [r + (" (swapped)" if r in host else "") for r in shown]
    ax_cpu.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=7, frameon=False)
    last = engine.step_log[-1] if engine.step_log else None
    if title is None:
        title = "before the first step" if last is None else (
            f"step {last['step']}: preempted {', '.join(last['preempted']) or '-'}, "
            f"{last['swapped_out']} blocks out, {last['swapped_in']} blocks in")
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.01, right=0.87, top=0.8, bottom=0.02, wspace=0.06)
    return fig


def describe_kv_tiers(engine) -> str:
    """The text fallback of :func:`draw_kv_tiers`: one line per step of what moved, then who holds what."""
    device, host = tier_owners(engine)
    last = engine.step_log[-1] if engine.step_log else None
    head = "before the first step" if last is None else (
        f"step {last['step']:3d}: preempted {', '.join(last['preempted']) or '-'}, {last['swapped_out']} out, "
        f"{last['swapped_in']} in")
    cpu = engine.kv.cpu_pool
    return (f"{head} | device {engine.pool.num_free}/{engine.pool.num_blocks} free, host "
            f"{cpu.num_free if cpu else 0}/{cpu.num_blocks if cpu else 0} free | swapped: {sorted(host) or '-'}")




class TierStepper(Stepper):
    """"next step" / "next swap" / "run to end" around an engine with a host tier, drawing :func:`draw_kv_tiers`.

    A :class:`Stepper` whose picture is the two tiers side by side and whose
    log line says what moved; "next swap" steps until blocks leave or return.
    """

    caption = "[KV tiers with step controls: run this notebook in Jupyter to click through]"

    def __init__(self, engine, figsize=(11, 2.3), stop: Callable[[Any], bool] | None = None) -> None:
        super().__init__(engine, draw=None, describe=describe_kv_tiers, figsize=figsize, stop=stop)
        self.colours: dict[str, int] = {}

    def paint(self, fig) -> None:
        draw_kv_tiers(self.engine, fig, colours=self.colours)

    def until_swap(self) -> str:
        """Step until a step moves blocks between the tiers (or the work runs out, or ``stop`` holds, as it ends
        "run to end" too); the last lines."""
        def moved(engine) -> bool:
            last = engine.step_log[-1]
            return bool(last.get("swapped_out") or last.get("swapped_in"))

        return "\n".join(self.step(10_000, until=moved).splitlines()[-3:])

    def actions(self):
        step, end = super().actions()
        return [step, ("next swap", self.until_swap), end]
# -- chunked prefill: time timeline, ITL histogram, budget/threshold sliders (lab 4) ------------


def draw_time_timeline(step_log: Sequence[dict], prompt_lens: dict[str, int], *, ax, starts: Sequence[float] | None = None,
                       title: str | None = None, max_rows: int = 24):
    """One row per request, x = time: a prefill chunk is a bar as long as its step; a decode is a tick when
    its token comes out.

    ``starts[i]`` is the clock before step ``i`` (default: the previous step's
    end).  A long prefill in one step shows as one long orange bar, and as a
    white gap of the same length in every decoding row: the stall.
    """
    from matplotlib.collections import PolyCollection

    spans: list[tuple[float, float]] = []
    prev = 0.0
    for i, e in enumerate(step_log):
        spans.append((starts[i] if starts is not None else prev, e["time"]))
        prev = e["time"]
    end = spans[-1][1] if spans else 1.0
    tick = 0.005 * (end - (spans[0][0] if spans else 0.0) or 1.0)
    bars: dict[str, dict[str, list]] = {}
    first_seen: dict[str, float] = {}
    for e, (t0, t1) in zip(step_log, spans):
        for (rid, s, n), decode in zip(e["seqs"], decode_flags(e, prompt_lens)):
            if decode:
                bars.setdefault(rid, {"prefill": [], "decode": []})["decode"].append((t1 - min(tick, t1 - t0), t1))
            else:
                bars.setdefault(rid, {"prefill": [], "decode": []})["prefill"].append((t0, t0 + 0.85 * (t1 - t0)))
            first_seen.setdefault(rid, t0)
    names = sorted(bars, key=lambda r: (first_seen[r], r))[:max_rows]
    colours = {"prefill": "#f28e2b", "decode": "#4e79a7"}
    for kind in ("decode", "prefill"):
        polys = [[(a, -y - 0.4), (b, -y - 0.4), (b, -y + 0.4), (a, -y + 0.4)]
                 for y, rid in enumerate(names) for a, b in bars[rid][kind]]
        ax.add_collection(PolyCollection(polys, facecolors=colours[kind], edgecolors="none"))
    ax.set_xlim(0, end)
    ax.set_ylim(-len(names) + 0.4, 0.6)
    ax.set_yticks([-y for y in range(len(names))], names, fontsize=6)
    ax.set_xlabel("time (s)")
    ax.legend([Rectangle((0, 0), 1, 1, color=colours["prefill"]), Rectangle((0, 0), 1, 1, color=colours["decode"])],
              ["prefill step", "decode token"], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize=7, frameon=False)
    ax.set_title(title or "who computed what, in time (a white gap in a row = that stream waits)", fontsize=9)
    return ax


def draw_itl_histogram(itls: Sequence[float], *, ax, target: float | None = None, title: str | None = None,
                       max_ms: float | None = None):
    """Histogram of inter-token latencies (ms, log count) with p50 / p99 / worst marked."""
    ms = sorted(1000 * g for g in itls)
    if not ms:
        ax.text(0.5, 0.5, "no gaps", ha="center", va="center", transform=ax.transAxes)
        return ax
    top = max_ms or max(ms) * 1.05
    ax.hist(ms, bins=40, range=(0, top), color="#4e79a7", log=True)

    def rank(q):
        return nearest_rank(ms, q)

    for value, label, style, y in ((rank(50), "p50", ":", 0.97), (rank(99), "p99", "--", 0.87),
                                   (ms[-1], "worst", "-", 0.77)):
        ax.axvline(value, color="#333333", ls=style, lw=1)
        ax.text(value, y, f" {label}", transform=ax.get_xaxis_transform(), fontsize=7, va="top")
    ax.set_ylim(bottom=0.7)
    if target is not None:
        ax.axvline(1000 * target, color="#d62728", lw=1.5)
        ax.text(1000 * target, 0.6, " target", color="#d62728", transform=ax.get_xaxis_transform(), fontsize=7)
    ax.set_xlim(0, top)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("gaps (log)")
    ax.set_title(title or f"decoders' ITL: p50 {rank(50):.0f} ms, p99 {rank(99):.0f} ms, worst {ms[-1]:.0f} ms",
                 fontsize=9)
    return ax


def draw_chunking(run: dict, fig=None, *, target: float | None = None, max_ms: float | None = None):
    """Time timeline (left) and ITL histogram (right) of one run on a Figure the caller owns.

    ``run`` has ``step_log``, ``prompt_lens``, ``itls`` (seconds), ``title`` and optionally ``starts``
    (see :func:`draw_time_timeline`).
    """
    from matplotlib.figure import Figure

    if fig is None:
        fig = Figure(figsize=(11, 3.4))
    fig.clear()
    ax_t, ax_h = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    draw_time_timeline(run["step_log"], run["prompt_lens"], ax=ax_t, starts=run.get("starts"))
    draw_itl_histogram(run["itls"], ax=ax_h, target=target, max_ms=max_ms)
    fig.suptitle(run.get("title", ""), fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.98, top=0.82, bottom=0.15, wspace=0.5)
    return fig


class BudgetExplorer(PictureWidget):
    """Two sliders -- ``max_num_batched_tokens`` and ``long_prefill_token_threshold`` -- that rerun a
    simulation and redraw :func:`draw_chunking`.

    ``simulate(budget, threshold)`` returns the ``run`` dict :func:`draw_chunking`
    takes (plus ``summary``, one line of text).  A :class:`PictureWidget` whose
    controls are sliders: each release reruns the (deterministic, cheap)
    simulation from scratch, so the widget holds no engine another cell could
    advance.
    """

    caption = "[budget and threshold sliders: run this notebook in Jupyter to move them]"

    def __init__(self, simulate: Callable[[int, int], dict], *, budget=(64, 4096, 64, 512),
                 threshold=(0, 2048, 64, 0), target: float | None = None, max_ms: float | None = None,
                 figsize=(11, 3.4)) -> None:
        super().__init__(figsize)
        self.simulate = simulate
        self.budget, self.threshold = budget, threshold
        self.target, self.max_ms = target, max_ms
        self.values = (budget[3], threshold[3])
        self.summary = ""
        self.log_lines = 1

    def paint(self, fig) -> None:
        run = self.simulate(*self.values)
        draw_chunking(run, fig, target=self.target, max_ms=self.max_ms)
        self.summary = run.get("summary", "")

    def render(self, budget: int, threshold: int) -> tuple[bytes, str]:
        """PNG and summary line for one setting (what moving the sliders there shows)."""
        self.values = (budget, threshold)
        return self.png(), self.summary

    def controls(self, w) -> list:
        # the sliders start where the picture is (a render() before show() moved it off the defaults)
        sliders = [w.IntSlider(value=v, min=lo, max=hi, step=st, description=d, continuous_update=False,
                               style={"description_width": "initial"}, layout={"width": "420px"})
                   for d, (lo, hi, st, _), v in (("max_num_batched_tokens", self.budget, self.values[0]),
                                                 ("long_prefill_token_threshold", self.threshold, self.values[1]))]

        def release() -> str:  # the summary line comes from the simulation the redraw runs
            self.values = (sliders[0].value, sliders[1].value)
            self.image.value = self.png()
            return self.summary

        def moved(_change):
            self.handle("sliders", release, redraw=False)

        for s in sliders:
            s.observe(moved, names="value")
        return [w.VBox(sliders)]

    def show(self) -> None:
        super().show()
        self.note(self.summary)
        print(self.summary)
