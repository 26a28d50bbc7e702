"""Pictures of the engine's state, drawn from the real objects, with step-through controls.

Three views, reusable across labs:

* :func:`draw_block_pool` -- every KV block as a cell, coloured by the request
  that holds it; a number shows the refcount where a block is shared; cached
  blocks nobody uses are hatched; free blocks are blank.
* :func:`draw_radix_tree` -- a :class:`~minivllm.kv.prefix.radix.RadixCache`'s
  trees: one box per node (its blocks), locked blocks (a running request
  holds them) outlined, and the LRU clock of each node.
* :func:`draw_timeline` -- one row per request, one column per engine step:
  prefill chunks vs decode tokens, with TTFT and ITL read off the same log.

:class:`Stepper` adds "next step" / "run to end" buttons around an engine.
Why both a static picture and a widget?  Widgets need a live kernel; GitHub,
nbval and HTML exports have none.  So every view is first drawn as a plain
matplotlib figure (which every renderer shows), and the controls come after
it with a short text fallback of their own.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

PALETTE = plt.get_cmap("tab20").colors


def _colour(i: int):
    return PALETTE[(2 * i) % 20] if i < 10 else PALETTE[(2 * (i - 10) + 1) % 20]


# -- block pool ---------------------------------------------------------------------


def block_owners(engine) -> dict[str, list[int]]:
    """``{request_id: block table}`` of every request holding blocks, in admission order."""
    return {r.request_id: list(r.block_ids) for r in engine.scheduler.running if r.block_ids}


def draw_block_pool(pool, tables: dict[str, Sequence[int]], *, cache: Any = None, cols: int = 16,
                    title: str | None = None, ax=None):
    """Draw ``pool``'s blocks; ``tables`` maps an owner name to its block table.

    A block in several tables is drawn in the first owner's colour with its
    refcount written on it, so sharing is visible at a glance.
    """
    n = pool.num_blocks
    rows = -(-n // cols)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 0.55 * cols + 2.5), 0.55 * rows + 0.9))
    owner_of: dict[int, int] = {}
    names = list(tables)
    for i, name in enumerate(names):
        for b in tables[name]:
            owner_of.setdefault(b, i)
    for b in range(n):
        r, c = divmod(b, cols)
        rc = pool.refcount(b)
        cached = cache is not None and cache.is_cached(b)
        if b in owner_of:
            face, hatch = _colour(owner_of[b]), None
        elif cached:
            face, hatch = "#eeeeee", "///"
        else:
            face, hatch = "white", None
        ax.add_patch(Rectangle((c, -r), 0.92, 0.92, facecolor=face, edgecolor="#555555", hatch=hatch, lw=0.8))
        label = str(b)
        if rc > 1:
            label += f"\n×{rc}"
        ax.text(c + 0.46, -r + 0.46, label, ha="center", va="center", fontsize=7)
    handles = [Rectangle((0, 0), 1, 1, facecolor=_colour(i)) for i in range(len(names))]
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
        for rid, start, num in entry["seqs"]:
            kind = "decode" if start >= prompt_lens[rid] else "prefill"
            rows.setdefault(rid, []).append((entry["step"], kind, num))
    return rows


def draw_timeline(step_log: Sequence[dict], prompt_lens: dict[str, int], *, ax=None, title: str | None = None,
                  annotate: bool = True):
    """One row per request, one column per step: orange = prefill chunk (tokens written), blue = decode."""
    rows = timeline_rows(step_log, prompt_lens)
    names = sorted(rows, key=lambda r: min(s for s, _, _ in rows[r]))
    steps = len(step_log)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 2 + 0.28 * steps), 0.9 + 0.35 * len(names)))
    for y, rid in enumerate(names):
        for step, kind, num in rows[rid]:
            colour = "#f28e2b" if kind == "prefill" else "#4e79a7"
            ax.add_patch(Rectangle((step, -y - 0.4), 0.95, 0.8, color=colour))
            if annotate and kind == "prefill":
                ax.text(step + 0.47, -y, str(num), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([-y for y in range(len(names))], names, fontsize=8)
    ax.set_xlim(0, max(steps, 1))
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
    for rid, start, num in entry["seqs"]:
        kind = "decode" if start >= prompt_lens[rid] else f"prefill[{start}:{start + num}]"
        parts.append(f"{rid} {kind}")
    extra = f"  preempted: {entry['preempted']}" if entry["preempted"] else ""
    return f"step {entry['step']:3d}: {entry['num_tokens']:4d} tokens | " + ", ".join(parts) + extra


# -- radix tree ------------------------------------------------------------------------


def radix_nodes(cache) -> list[dict]:
    """Flatten a RadixCache into ``[{id, parent, depth, blocks, locked, last_access, namespace}]``."""
    out: list[dict] = []
    ids: dict[int, int] = {}

    def visit(node, parent_id, depth):
        nid = len(out)
        ids[id(node)] = nid
        out.append({"id": nid, "parent": parent_id, "depth": depth, "blocks": list(node.block_ids),
                    "locked": [b for b in node.block_ids if cache.pool.refcount(b) > 1],
                    "last_access": node.last_access, "namespace": node.namespace,
                    "first_tokens": node.token_blocks[0][:3] if node.token_blocks else ()})
        for key in sorted(node.children, key=lambda k: k):
            visit(node.children[key], nid, depth + 1)

    for ns in sorted(cache._roots):
        visit(cache._roots[ns], None, 0)
    return out


def namespace_label(namespace) -> str:
    """A readable name for a cache namespace: the engine's ``(tenant, salt)`` tuple, or anything else."""
    if isinstance(namespace, tuple) and len(namespace) == 2:
        tenant, salt = namespace
        parts = ([f"tenant={tenant}"] if tenant is not None else ["shared"]) + ([f"salt={salt}"] if salt else [])
        return ", ".join(parts)
    return repr(namespace) if namespace not in ((), "", None) else "public"


def describe_radix_tree(cache) -> str:
    """Indented text version of :func:`draw_radix_tree`."""
    lines = []
    for n in radix_nodes(cache):
        if n["parent"] is None:
            lines.append(f"root[{namespace_label(n['namespace'])}]")
            continue
        lock = f" locked={n['locked']}" if n["locked"] else ""
        lines.append("  " * n["depth"] + f"└ blocks {n['blocks']} (t={n['last_access']}){lock}")
    return "\n".join(lines)


def draw_radix_tree(cache, *, ax=None, title: str | None = None):
    """Boxes per node (its block ids), edges to children; red outline = locked by a running request."""
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
        _, ax = plt.subplots(figsize=(min(12, 1.6 + 1.7 * max(next_x[0], 1)), 1.2 + 1.1 * depth))
    for n in nodes:
        x, y = xs[n["id"]], -n["depth"]
        if n["parent"] is not None:
            ax.plot([xs[n["parent"]], x], [-n["depth"] + 1 - 0.2, y + 0.2], color="#888888", lw=1, zorder=1)
        if n["parent"] is None:
            label = f"root {namespace_label(n['namespace'])}"
            ax.text(x, y, label, ha="center", va="center", fontsize=8,
                    bbox=dict(boxstyle="round", fc="#dddddd", ec="#555555"))
            continue
        b = n["blocks"]
        shown = ", ".join(map(str, b)) if len(b) <= 4 else f"{b[0]}, {b[1]}, …, {b[-1]}"
        label = f"{len(b)} blk [{shown}]\nt={n['last_access']}"
        ec = "#d62728" if n["locked"] else "#555555"
        ax.text(x, y, label, ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", fc="#e8f1fa", ec=ec, lw=2 if n["locked"] else 1))
    ax.set_xlim(-0.8, max(next_x[0] - 0.5, 1) + 0.3)
    ax.set_ylim(-depth - 0.6, 0.6)
    ax.axis("off")
    ax.set_title(title or f"radix tree: {cache.num_cached_blocks} cached blocks, red = locked "
                 f"(in use), t = last access", fontsize=10)
    return ax


# -- step-through control ----------------------------------------------------------------


class Stepper:
    """"next step" / "run to end" buttons around a live engine, redrawing a view each time.

    ``draw(engine, ax)`` draws the view; ``describe(engine)`` gives a text line
    per step for the log.  :meth:`show` draws the current state as a static
    figure first (so any renderer shows something), then the controls.
    """

    def __init__(self, engine, draw: Callable[[Any, Any], Any], describe: Callable[[Any], str],
                 figsize=(11, 3.2)) -> None:
        self.engine = engine
        self.draw = draw
        self.describe = describe
        self.figsize = figsize
        self.widget = None

    def _figure(self):
        fig, ax = plt.subplots(figsize=self.figsize)
        self.draw(self.engine, ax)
        fig.tight_layout()
        return fig

    def step(self, n: int = 1) -> str:
        lines = []
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                lines.append("no work left")
                break
            self.engine.step()
            lines.append(self.describe(self.engine))
        return "\n".join(lines)

    def show(self):
        from IPython.display import display

        fig = self._figure()
        plt.show()
        plt.close(fig)
        try:
            import ipywidgets as w
        except ImportError:  # static fallback only
            return None
        out = w.Output()
        log = w.Output()
        next_b = w.Button(description="next step")
        end_b = w.Button(description="run to end")

        def refresh(text):
            with log:
                print(text)
            out.clear_output(wait=True)
            with out:
                f = self._figure()
                plt.show()
                plt.close(f)

        next_b.on_click(lambda _: refresh(self.step(1)))
        end_b.on_click(lambda _: refresh(self.step(10_000)))
        self.widget = _Controls([w.HBox([next_b, end_b]), out, log])
        display(self.widget)
        return None


try:
    import ipywidgets as _w

    class _Controls(_w.VBox):
        """A VBox whose text fallback is one short, stable line (nbval compares text/plain)."""

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            bundle = dict(bundle or {})
            bundle["text/plain"] = "[step controls: run this notebook in Jupyter to click through the steps]"
            return bundle
except ImportError:  # pragma: no cover
    _Controls = None  # type: ignore[assignment]
