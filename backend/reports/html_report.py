"""``Explanation.to_html(path)``: one self-contained page (no scripts, no external files) with the
sharded graph, the communication table and the memory table."""
from __future__ import annotations

import html
import pathlib
from typing import Any

import torch.fx as fx

from fxshard.graph import LAYOUT
from fxshard.layout import Layout
from fxshard.ops import REDISTRIBUTE
from fxshard.printing import format_graph

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { margin: 0; font-family: ui-monospace, monospace; white-space: pre-wrap; }
tr.redistribute { background: #fff1c2; font-weight: 600; }
tr.input { color: #555; }
"""


def _row(cells: list[str], cls: str = "", numeric: tuple[int, ...] = ()) -> str:
    tds = "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(cells))
    return f'<tr class="{cls}">{tds}</tr>' if cls else f"<tr>{tds}</tr>"


def _graph_rows(gm: fx.GraphModule) -> list[str]:
    lines = format_graph(gm).splitlines()
    nodes = list(gm.graph.nodes)
    rows = []
    for node, line in zip(nodes, lines):
        cls = "redistribute" if node.target is REDISTRIBUTE else "input" if node.op == "placeholder" else ""
        layout = node.meta.get(LAYOUT)
        local = "[" + ", ".join(str(s) for s in layout.max_local_shape()) + "]" if isinstance(layout, Layout) else ""
        rows.append(_row([f"<pre>{html.escape(line)}</pre>", f"<pre>{html.escape(local)}</pre>"], cls))
    return rows


def render(e: Any, title: str = "fxshard explanation") -> str:
    comm = [_row([html.escape(c.kind), html.escape(",".join(str(a) for a in c.axes)), html.escape(str(c.bytes_per_rank)),
                  f"%{html.escape(c.node.name)}", html.escape(c.reason)], numeric=(2,)) for c in e.collectives]
    totals = [_row([html.escape(axes), html.escape(str(b))], numeric=(1,)) for axes, b in e.bytes_by_axes().items()]
    memory = e.memory
    mem = [_row([f"%{html.escape(name)}", html.escape(str(b))], numeric=(1,)) for name, b in memory.inputs.items()]
    mem.append(_row(["<b>inputs, total</b>", html.escape(str(memory.input_bytes))], numeric=(1,)))
    mem.append(_row(["<b>peak activations (estimate)</b>", html.escape(str(memory.peak_activations))], numeric=(1,)))
    assumptions = "".join(f"<li>{html.escape(a)}</li>" for a in e.assumptions)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(e.summary())}</p>",
        f"<h2>Assumed for the symbolic mesh</h2><ul>{assumptions}</ul>" if assumptions else "",
        "<h2>Communication</h2>",
        "<table><tr><th>collective</th><th>axes</th><th>bytes / rank</th><th>at</th><th>why</th></tr>",
        "".join(comm) or _row(["none", "", "", "", ""]), "</table>",
        "<h2>Totals per mesh axis</h2><table><tr><th>axes</th><th>bytes / rank</th></tr>",
        "".join(totals) or _row(["none", "0"]), "</table>",
        "<h2>Memory per rank</h2><table><tr><th>value</th><th>bytes</th></tr>", "".join(mem), "</table>",
        "<h2>Sharded graph</h2><p>one row per node: shape, layout, op; redistributions highlighted</p>",
        "<table><tr><th>node: global shape, layout = op</th><th>local shape (largest block)</th></tr>",
        "".join(_graph_rows(e.graph)), "</table></body></html>",
    ]
    return "\n".join(parts)


def write_html(e: Any, path: str | pathlib.Path, title: str = "fxshard explanation") -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text(render(e, title), encoding="utf-8")
    return path
