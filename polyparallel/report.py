"""A strategy (and optionally a run) as one self-contained HTML page: inline CSS and SVG, no script.

:func:`render` turns a :class:`~polyparallel.strategy.Strategy` and, optionally, the records of a
run (:func:`read_run`) into the page's HTML string. Every number drawn comes from the strategy or
the run records:

* the cluster diagram: centers, nodes and devices from ``strategy.cluster``, each device's mesh
  coordinates from ``strategy.mesh`` (row-major), colored by pipeline stage or by center;
* memory per device (``estimate.memory_by_device``), the step-time breakdown (``estimate.breakdown``)
  and the compute of each stage (``stages[].compute_s``);
* the pipeline timeline, simulated task by task over the schedule order of
  :mod:`polyparallel.cost_models.pipeline` from each stage's compute time (split 1:2 into forward
  and backward, which the strategy does not keep apart), or, for a collaborative strategy, the
  planned round: each center's ``H`` local steps, then its upload and download of the model;
* with a run: loss and step time per step (``train.jsonl`` of ``polyparallel train``), or the
  per-round losses per center, the federation's evaluation and the phase times of each round
  (``rounds.jsonl`` / ``result.json`` and ``timing.jsonl`` of ``polyparallel collab``).

Examples:
    >>> from polyparallel.strategy import Mesh, MeshAxis, ModelInfo, Strategy
    >>> s = Strategy(model=ModelInfo(name="mlp", fingerprint="0" * 24),
    ...              mesh=Mesh(axes=[MeshAxis(name="dp", size=2)], devices=[0, 1]), dp=2)
    >>> page = render(s)
    >>> page.startswith("<!DOCTYPE html>") and 'id="cluster"' in page
    True
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from polyparallel.cost_models.pipeline import schedule_order, simulate
from polyparallel.plan import CHUNKED_SCHEDULES, parse_schedule
from polyparallel.strategy import Strategy

__all__ = ["Run", "pipeline_tasks", "read_run", "render"]

COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
          "#bab0ac")
PHASE_COLORS = {"local training": "#4e79a7", "upload": "#f28e2b", "download": "#59a14f", "fusion": "#e15759",
                "waiting": "#d3d3d3", "compute": "#4e79a7", "F": "#8cb4dc", "B": "#2f5f8f"}
CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1360px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd}
.facts{display:flex;flex-wrap:wrap;gap:8px;margin:12px 0}
.fact{background:#f4f6f8;border-radius:6px;padding:6px 10px} .fact b{display:block;font-size:16px}
.note{color:#666;font-size:12px;margin:4px 0} svg{display:block;margin:6px 0}
svg text{font-family:system-ui,sans-serif} table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right} th{background:#f4f6f8}
td:first-child,th:first-child{text-align:left}
"""


# -- run records ----------------------------------------------------------------------------------
@dataclass
class Run:
    """The records of one run: ``kind`` is ``torch`` (steps) or ``collab`` (rounds, timing)."""

    path: Path
    kind: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    timing: list[dict[str, Any]] = field(default_factory=list)
    flagged: dict[str, Any] = field(default_factory=dict)  # result.json's: center -> rounds and why


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); the file is damaged, rerun to rewrite "
                                 "it") from None
    return out


def read_run(path: str | Path) -> Run:
    """Read a run folder: ``polyparallel train --run-dir`` or ``polyparallel collab --out`` / ``serve --out``."""
    p = Path(path)
    fix = ("give the --run-dir of `polyparallel train` (train.jsonl) or the --out of `polyparallel collab` "
           "(result.json or rounds.jsonl)")
    if not p.is_dir():
        raise ValueError(f"run folder {p} {'is a file' if p.exists() else 'does not exist'}; {fix}")
    if (p / "train.jsonl").is_file():
        steps = [r for r in _jsonl(p / "train.jsonl") if "step" in r]
        if not steps:
            raise ValueError(f"{p / 'train.jsonl'} holds no step records yet; {fix} after at least one step")
        return Run(p, "torch", steps=steps)
    rounds: list[dict[str, Any]] = []
    timing: list[dict[str, Any]] = []
    flagged: dict[str, Any] = {}
    if (p / "result.json").is_file():
        result = json.loads((p / "result.json").read_text())
        rounds, timing = list(result.get("rounds", [])), list(result.get("timing", []))
        flagged = dict(result.get("flagged", {}))
    for folder in (p, p / "flower"):
        if not rounds and (folder / "rounds.jsonl").is_file():
            rounds = _jsonl(folder / "rounds.jsonl")
        if not timing and (folder / "timing.jsonl").is_file():
            timing = _jsonl(folder / "timing.jsonl")
    if not rounds:
        raise ValueError(f"{p} holds no run records (no train.jsonl, result.json or rounds.jsonl); {fix}")
    return Run(p, "collab", rounds=rounds, timing=timing, flagged=flagged)


# -- formatting -----------------------------------------------------------------------------------
def _t(x: float) -> str:
    """Seconds, readably."""
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        return f"{x * 1e6:.1f} µs"
    return f"{x * 1e3:.2f} ms" if abs(x) < 1 else f"{x:.3f} s"


def _b(x: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _num(x: float) -> str:
    return f"{x:.4g}"


def _text(x: float, y: float, s: str, size: int = 11, anchor: str = "start", fill: str = "#222",
          extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{extra}>'
            f"{escape(s)}</text>")


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str = "", extra: str = "") -> str:
    title = f"<title>{escape(tip)}</title>" if tip else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{h:.2f}" fill="{fill}"{extra}>'
            f"{title}</rect>")


def _svg(id_: str, width: float, height: float, body: list[str], cls: str = "chart") -> str:
    return (f'<svg id="{id_}" class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">' + "".join(body) + "</svg>")


def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + " ".join(
        f'<span style="display:inline-block;width:10px;height:10px;background:{c}"></span> {escape(n)} &nbsp;'
        for n, c in items) + "</div>"


def _table(header: list[str], rows: list[list[str]], id_: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    ident = f' id="{id_}"' if id_ else ""
    return f"<table{ident}><tr>{head}</tr>{body}</table>"


# -- generic charts ---------------------------------------------------------------------------------
def bars_svg(id_: str, items: list[tuple[str, float, str]], color: str = COLORS[0]) -> str:
    """Horizontal bars ``(label, value, text shown after the bar)``, scaled to the largest value."""
    top = max((v for _, v, _ in items), default=0.0) or 1.0
    body = []
    for i, (label, v, txt) in enumerate(items):
        y = 4 + i * 24
        body.append(_text(0, y + 13, label))
        body.append(_rect(260, y, 560 * v / top, 18, color, f"{label}: {txt}", ' class="bar"'))
        body.append(_text(266 + 560 * v / top, y + 13, txt))
    return _svg(id_, 1200, 8 + 24 * len(items), body)


def stacked_svg(id_: str, rows: list[tuple[str, list[tuple[str, float]]]], fmt: Any = _t) -> str:
    """One 100 % bar per row, split into named parts (colored by name); the row's total is printed."""
    names = list(dict.fromkeys(n for _, parts in rows for n, v in parts if v > 0))
    color = {n: PHASE_COLORS.get(n, COLORS[i % len(COLORS)]) for i, n in enumerate(names)}
    body = []
    for i, (label, parts) in enumerate(rows):
        y, x, total = 4 + i * 26, 160.0, sum(v for _, v in parts) or 1.0
        body.append(_text(0, y + 14, label))
        for n, v in parts:
            if v > 0:
                w = 900 * v / total
                body.append(_rect(x, y, w, 20, color[n], f"{n}: {fmt(v)} ({100 * v / total:.1f}%)",
                                  f' class="part" data-part="{escape(n)}"'))
                if w > 60:
                    body.append(_text(x + 3, y + 14, f"{100 * v / total:.0f}%", 10, fill="#fff"))
                x += w
        body.append(_text(1066, y + 14, fmt(total)))
    return _svg(id_, 1200, 8 + 26 * len(rows), body) + _legend([(n, color[n]) for n in names])


def gantt_svg(id_: str, rows: list[str], tasks: list[tuple[int, float, float, str, str]], end: float,
              marks: list[tuple[float, str]] = ()) -> str:
    """Tasks ``(row, start, end, kind, label)`` on a time axis from 0 to ``end`` seconds."""
    left, width = 130, 1040
    scale = width / (end or 1.0)
    kinds = list(dict.fromkeys(k for _, _, _, k, _ in tasks))
    color = {k: PHASE_COLORS.get(k, COLORS[i % len(COLORS)]) for i, k in enumerate(kinds)}
    axis_y = 24 + 28 * len(rows)
    body = [_text(0, 20 + 28 * r + 14, name) for r, name in enumerate(rows)]
    for i in range(6):
        x = left + width * i / 5
        body.append(f'<line x1="{x:.1f}" y1="16" x2="{x:.1f}" y2="{axis_y:.1f}" stroke="#ddd"/>')
        body.append(_text(x, axis_y + 14, _t(end * i / 5), 10, "middle"))
    for r, a, z, kind, label in tasks:
        x, w, y = left + a * scale, (z - a) * scale, 20 + 28 * r
        body.append(_rect(x, y, w, 22, color[kind], f"{rows[r]} {label}: {_t(a)} .. {_t(z)}",
                          f' class="task" data-kind="{escape(kind)}" stroke="#fff" stroke-width="0.5"'))
        if w > 7 * len(label) + 4:
            body.append(_text(x + w / 2, y + 15, label, 10, "middle", "#fff"))
    for t, label in marks:
        x = left + t * scale
        body.append(f'<line class="mark" x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{axis_y:.1f}" stroke="#e15759" '
                    f'stroke-dasharray="4 3"/>')
        body.append(_text(x - 4, 10, label, 10, "end", "#e15759"))
    return _svg(id_, 1200, axis_y + 24, body) + _legend([(k, color[k]) for k in kinds])


def line_svg(id_: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str) -> str:
    """Line chart of named series of ``(x, y)`` points."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    x1 = x1 if x1 > x0 else x0 + 1
    left, top, w, h = 70, 10, 560, 220

    def px(x: float, y: float) -> str:
        return f"{left + w * (x - x0) / (x1 - x0):.1f},{top + h * (1 - (y - y0) / (y1 - y0)):.1f}"

    body = [f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fafafa" stroke="#ccc"/>']
    whole = all(float(p[0]).is_integer() for p in pts)  # steps, rounds: integer ticks
    xticks = sorted({round(x0 + (x1 - x0) * i / 4) for i in range(5)}) if whole else [
        x0 + (x1 - x0) * i / 4 for i in range(5)]
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        yy = top + h * (1 - i / 4)
        body.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{left + w}" y2="{yy:.1f}" stroke="#eee"/>')
        body.append(_text(left - 4, yy + 4, _num(y), 10, "end"))
    for x in xticks:
        body.append(_text(left + w * (x - x0) / (x1 - x0), top + h + 14, _num(x), 10, "middle"))
    body.append(_text(left + w / 2, top + h + 30, xlabel, 11, "middle"))
    body.append(_text(14, top + h / 2, ylabel, 11, "middle", extra=f' transform="rotate(-90 14 {top + h / 2})"'))
    legend = []
    for i, (name, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        legend.append((name, c))
        body.append(f'<polyline class="series" data-series="{escape(name)}" fill="none" stroke="{c}" '
                    f'stroke-width="2" points="{" ".join(px(x, y) for x, y in s)}"/>')
        if len(s) <= 60:
            body += [f'<circle cx="{px(x, y).split(",")[0]}" cy="{px(x, y).split(",")[1]}" r="2.5" fill="{c}">'
                     f"<title>{escape(name)} {_num(x)}: {_num(y)}</title></circle>" for x, y in s]
    return _svg(id_, 660, top + h + 40, body, "chart line") + _legend(legend)


# -- the cluster ------------------------------------------------------------------------------------
def _coords(s: Strategy) -> dict[int, str]:
    """Each device's mesh coordinates (row-major over ``mesh.axes``) as ``pp0 dp1``."""
    out = {}
    shown = [a for a in s.mesh.axes if a.size > 1 or a.name == "dp"]
    for i, d in enumerate(s.mesh.devices):
        rest, coord = i, {}
        for a in reversed(s.mesh.axes):
            coord[a.name], rest = rest % a.size, rest // a.size
        out[d] = " ".join(f"{a.name}{coord[a.name]}" for a in shown)
    return out


def _groups(s: Strategy) -> tuple[dict[int, int], list[tuple[str, str]]]:
    """Color index per device and the legend: pipeline stages, or centers of a collaborative plan."""
    if s.collaborative:
        groups = [(f"{c.name} ({c.framework}, dp={c.local_strategy.get('dp')} tp={c.local_strategy.get('tp')} "
                   f"pp={c.local_strategy.get('pp')}, {100 * c.share:.1f}% of the data)", c.devices)
                  for c in s.collaborative.centers]
    elif s.stages:
        groups = [(f"stage {st.index}: layers {_span(st.layers)}, compute {_t(st.compute_s)}", st.devices)
                  for st in s.stages]
    else:
        groups = [("all devices", s.mesh.devices)]
    index = {d: i for i, (_, devs) in enumerate(groups) for d in devs}
    return index, [(n, COLORS[i % len(COLORS)]) for i, (n, _) in enumerate(groups)]


def _span(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else (str(ids[0]) if ids else "-")


def cluster_svg(s: Strategy) -> str:
    """Centers > nodes > devices; each device colored by its stage (or center), labelled with its coordinates."""
    centers = s.cluster.get("centers") or [{"name": s.cluster.get("name", "cluster"),
                                            "nodes": [{"name": "devices", "devices": s.mesh.devices}]}]
    coords = {} if s.collaborative else _coords(s)
    group, legend = _groups(s)
    longest = max((len(c) for c in coords.values()), default=0)
    dw, dh = max(74, 6 * longest + 6), 34  # 9 px text: ~5.5 px a character
    per_row = max(1, 1010 // (dw + 4))
    body, y = [], 4
    for ce in centers:
        wan = ce.get("wan") or {}
        link = (f" · WAN up {_b(wan['up_Bps'])}/s down {_b(wan['down_Bps'])}/s" if wan.get("up_Bps") else "")
        fw = f" ({ce['framework']})" if ce.get("framework") else ""
        top = y
        y += 22
        node_rows = []
        for node in ce.get("nodes", []):
            devs = node.get("devices", [])
            rows = max(1, -(-len(devs) // per_row))
            node_rows.append((node, devs, y))
            y += rows * (dh + 4) + 10
        body.append(_rect(2, top, 1190, y - top, "#f7f8fa", extra=' class="center" stroke="#bbb" rx="6"'))
        body.append(_text(10, top + 16, f"{ce.get('name', '')}{fw}{link}", 13, extra=' font-weight="bold"'))
        for node, devs, ny in node_rows:
            body.append(_text(12, ny + 14, node.get("name", ""), 11))
            body.append(_text(12, ny + 28, node.get("device_type", ""), 10, fill="#666"))
            for k, d in enumerate(devs):
                x, yy = 170 + (k % per_row) * (dw + 4), ny + (k // per_row) * (dh + 4)
                g = group.get(d)
                fill = COLORS[g % len(COLORS)] if g is not None else "#e0e0e0"
                label = coords.get(d, "")
                tip = f"device {d}" + (f": {label}" if label else "") + ("" if g is not None else " (unused)")
                body.append(_rect(x, yy, dw, dh, fill, tip, f' class="device" data-device="{d}" rx="3"'))
                ink = "#fff" if g is not None else "#666"
                body.append(_text(x + dw / 2, yy + 13, f"dev {d}", 10, "middle", ink))
                if label:
                    body.append(_text(x + dw / 2, yy + 27, label, 9, "middle", ink))
        y += 8
    axes = _table(["mesh axis (row-major)", "size", "a group spans"],
                  [[a.name, str(a.size), a.level.replace("_", " ")] for a in s.mesh.axes], "mesh-axes")
    return _svg("cluster", 1200, y, body, "diagram") + _legend(legend) + axes


# -- estimate sections ------------------------------------------------------------------------------
def _capacity(s: Strategy, device: int) -> float:
    for ce in s.cluster.get("centers", []):
        for node in ce.get("nodes", []):
            if device in node.get("devices", []):
                return float(s.cluster.get("device_types", {}).get(node.get("device_type"), {})
                             .get("memory_bytes", 0.0))
    return 0.0


def memory_section(s: Strategy) -> str:
    if not s.estimate or not s.estimate.memory_by_device:
        return '<p class="note">The strategy records no memory per device.</p>'
    items = []
    for label, v in s.estimate.memory_by_device.items():
        m = re.search(r"devices? (\d+)", label)
        cap = _capacity(s, int(m.group(1))) if m else 0.0
        share = f"{100 * v / cap:.1f}%" if not cap or v / cap >= 1e-3 else "<0.1%"
        items.append((label, v, f"{_b(v)}" + (f" of {_b(cap)} ({share})" if cap else "")))
    return bars_svg("memory", items, COLORS[2])


def time_section(s: Strategy) -> str:
    e = s.estimate
    parts = [(k, v) for k, v in e.breakdown.items() if v > 0] if e else []
    out = ""
    if parts:
        title = "critical stage" if s.mode == "synchronous" else "round"
        out += stacked_svg("breakdown", [(title, parts)])
        out += _table(["part", "time", "share"], [[k, _t(v), f"{100 * v / sum(x for _, x in parts):.1f}%"]
                                                  for k, v in parts], "breakdown-table")
    if s.stages:
        out += "<h3>Compute per stage (all micro-batches of one step)</h3>"
        out += bars_svg("stage-compute", [(f"stage {st.index} ({st.device_type})", st.compute_s, _t(st.compute_s))
                                          for st in s.stages])
    if s.collaborative:
        c = s.collaborative
        items = [(ce.name, float(ce.local_strategy.get("step_time_s", 0.0)),
                  f"{_t(float(ce.local_strategy.get('step_time_s', 0.0)))} per local step, "
                  f"{float(ce.local_strategy.get('samples_per_s', 0.0)):,.0f} samples/s") for ce in c.centers]
        out += "<h3>Local step time per center (its own best plan)</h3>" + bars_svg("center-steps", items)
    return out or '<p class="note">The strategy records no estimate.</p>'


def _schedule(s: Strategy) -> tuple[str, int]:
    name, chunks = parse_schedule(s.schedule)
    return name, 2 if name in CHUNKED_SCHEDULES and chunks == 1 else chunks  # a bare "interleaved": 2 chunks


def pipeline_tasks(s: Strategy) -> tuple[list[tuple[int, float, float, str, str]], Any]:
    """Start and end of every forward / backward of one step, and the cost model's simulation of it.

    Each stage's ``compute_s`` covers all micro-batches of the step; a micro-batch's forward takes
    a third of its share and its backward two thirds. Tasks run in the per-stage order of
    :func:`~polyparallel.cost_models.pipeline.schedule_order` as soon as their input is ready
    (no point-to-point time: the strategy keeps only its exposed total); the makespan equals
    :func:`~polyparallel.cost_models.pipeline.simulate`'s, which is returned beside the tasks.
    """
    name, v = _schedule(s)
    p, m = len(s.stages), s.microbatches
    fwd = [st.compute_s / m / 3 for st in s.stages]
    bwd = [2 * st.compute_s / m / 3 for st in s.stages]
    sim = simulate(name, fwd, bwd, m, v)
    v = sim.chunks
    order = schedule_order(name, p, m, v)
    done: dict[tuple[str, int, int], float] = {}
    free, pos, tasks = [0.0] * p, [0] * p, []
    while any(pos[r] < len(order[r]) for r in range(p)):
        for r in range(p):
            while pos[r] < len(order[r]):
                kind, j, c = order[r][pos[r]]
                g = c * p + r
                dep = (("F", j, g - 1) if g else None) if kind == "F" else (
                    ("B", j, g + 1) if g < p * v - 1 else ("F", j, g))
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0.0)
                free[r] = done[(kind, j, g)] = start + (fwd[r] if kind == "F" else bwd[r]) / v
                tasks.append((r, start, free[r], kind, f"{kind}{j}" + (f".{c}" if v > 1 else "")))
                pos[r] += 1
    return tasks, sim


def pipeline_section(s: Strategy) -> str:
    if not s.stages or not any(st.compute_s for st in s.stages):
        return '<p class="note">No pipeline: the strategy has no stage compute times.</p>'
    tasks, sim = pipeline_tasks(s)
    note = (f'<p class="note">{s.schedule}, {len(s.stages)} stage(s) × {s.microbatches} micro-batch(es): simulated '
            f"makespan {_t(sim.makespan)}, bubble {100 * sim.bubble_fraction:.1f}% (cost_models.pipeline); forward "
            f"= 1/3 and backward = 2/3 of each stage's compute per micro-batch. The estimated step "
            f"({_t(s.estimate.step_time_s) if s.estimate else '?'}) adds point-to-point, data-parallel and "
            "optimizer time.</p>")
    return note + gantt_svg("pipeline", [f"stage {st.index}" for st in s.stages], tasks, sim.makespan)


def round_plan_section(s: Strategy) -> str:
    """The planned round: each center trains H local steps on its share, then sends and receives the model.

    The model's bytes are not stored; they are solved from the fusion time the search priced
    (the slowest center's upload + download + 2 latencies over its WAN link).
    """
    c = s.collaborative
    assert c is not None
    wans = {ce["name"]: ce.get("wan") or {} for ce in s.cluster.get("centers", [])}
    fusion = s.estimate.breakdown.get("fusion", 0.0) if s.estimate else 0.0

    def inv(w: dict[str, Any]) -> float:
        return 1 / w["up_Bps"] + 1 / w["down_Bps"]

    linked = [w for w in wans.values() if w.get("up_Bps")]
    model_bytes = min(((fusion - 2 * w["latency_s"]) / inv(w) for w in linked), default=0.0)
    tasks, rows = [], []
    for r, ce in enumerate(c.centers):
        rate = float(ce.local_strategy.get("samples_per_s", 0.0))
        local = ce.share * s.global_batch * c.local_steps / rate if rate else 0.0
        rows.append(ce.name)
        tasks.append((r, 0.0, local, "local training", f"H={c.local_steps}"))
        w = wans.get(ce.name, {})
        if w.get("up_Bps") and model_bytes > 0:
            up = model_bytes / w["up_Bps"] + w["latency_s"]
            down = model_bytes / w["down_Bps"] + w["latency_s"]
            tasks += [(r, local, local + up, "upload", "up"), (r, local + up, local + up + down, "download", "down")]
    note = (f'<p class="note">{len(c.centers)} centers, {c.fusion} every H={c.local_steps} local steps, round '
            f"{_t(c.round_time_s)}, communication {100 * c.comm_fraction:.1f}% of the round"
            + (f"; model {_b(model_bytes)} each way" if model_bytes > 0 else "") + ".</p>")
    return note + gantt_svg("round-plan", rows, tasks, c.round_time_s, [(c.round_time_s, "round end")])


# -- run sections -----------------------------------------------------------------------------------
def torch_run_section(s: Strategy, run: Run) -> str:
    loss = [(float(r["step"]), float(r["loss"])) for r in run.steps if isinstance(r.get("loss"), int | float)]
    times = [(float(r["step"]), float(r["step_time_s"])) for r in run.steps if "step_time_s" in r]
    out = f'<p class="note">{len(run.steps)} step records from {escape(str(run.path / "train.jsonl"))}.'
    later = [t for _, t in times[1:]] or [t for _, t in times]
    if later and s.estimate:
        mean = sum(later) / len(later)
        out += (f" Measured step {_t(mean)} (mean after the first step) vs estimated "
                f"{_t(s.estimate.step_time_s)}.")
    out += "</p>"
    out += "<h3>Loss per step</h3>" + line_svg("run-loss", {"loss": loss}, "step", "loss")
    series = {"measured": times}
    if s.estimate and times:
        series["estimated"] = [(times[0][0], s.estimate.step_time_s), (times[-1][0], s.estimate.step_time_s)]
    return out + "<h3>Step time</h3>" + line_svg("run-step-time", series, "step", "seconds")


def _phases(run: Run) -> list[tuple[int, dict[str, float]]]:
    """Seconds per phase of each round from the timing events, summed over the centers' own phases."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for ev in run.timing:
        by_round.setdefault(int(ev["round"]), []).append(ev)
    out = []
    for r, evs in sorted(by_round.items()):
        at = {(e["who"], e["event"]): float(e["t"]) for e in evs}
        start = at.get(("server", "round_start"))
        centers = sorted({e["who"] for e in evs if e["role"] == "center"})
        ph = {"download": 0.0, "local training": 0.0, "upload": 0.0}
        for c in centers:
            got, trained, recv = (at.get((c, e)) for e in ("received_model", "finished_training", "update_received"))
            if start is not None and got is not None:
                ph["download"] += max(0.0, got - start) / len(centers)
            if got is not None and trained is not None:
                ph["local training"] += (trained - got) / len(centers)
            if trained is not None and recv is not None:
                ph["upload"] += max(0.0, recv - trained) / len(centers)
        fs, fe, end = at.get(("server", "fusion_start")), at.get(("server", "fusion_end")), at.get(
            ("server", "round_end"))
        ph["fusion"] = (fe - fs) if fs is not None and fe is not None else 0.0
        if start is not None and end is not None:
            ph["waiting"] = max(0.0, (end - start) - sum(ph.values()))
        out.append((r, ph))
    return out


_CHECKS = (("update_norm", "norm"), ("layer_ratio", "max layer ratio"), ("cos_fused", "cos to fused"),
           ("cos_others", "cos to others"), ("cos_consensus", "cos to consensus"), ("cos_root", "cos to root"),
           ("trust", "trust"))


def _audit(rounds: list[dict[str, Any]], flagged: dict[str, Any]) -> str:
    """Per round and center, what the server's checks measured on the update and what it decided
    (the round records' metrics and refusals), and the centers flagged in some round."""
    shown = [(k, h) for k, h in _CHECKS if any(k in m for r in rounds for m in r.get("metrics", {}).values())]
    rows = []
    for r in rounds:
        for c in sorted({*r.get("metrics", {}), *r.get("rejected", {})}):
            m = r.get("metrics", {}).get(c, {})
            why = r.get("rejected", {}).get(c)
            rows.append([str(r["round"]), c, *(f"{m[k]:.4g}" if k in m else "" for k, _ in shown),
                         "refused: " + "; ".join(why) if why else "accepted"])
    if not rows:
        return ""
    out = ("<h3>Update checks per round and center</h3><p class=\"note\">What the server measured on each "
           "update before fusing it (norm; its largest tensor norm over that tensor's median; cosine to the fused "
           "step, to the other centers' median, to the consensus, to the server's root update; the fusion's trust) "
           "and its decision.</p>"
           + _table(["round", "center", *(h for _, h in shown), "decision"], rows, "run-audit"))
    if flagged:
        out += "<h3>Flagged centers</h3>" + _table(
            ["center", "rounds", "why (last)"],
            [[c, ", ".join(map(str, f.get("rounds", []))), (f.get("why") or [""])[-1]] for c, f in flagged.items()],
            "run-flagged")
    return out


def collab_run_section(run: Run) -> str:
    rounds = sorted(run.rounds, key=lambda r: r["round"])
    train: dict[str, list[tuple[float, float]]] = {}
    for rec in rounds:
        for center, m in rec.get("metrics", {}).items():
            if "train_loss" in m:
                train.setdefault(center, []).append((float(rec["round"]), float(m["train_loss"])))
    evals = {k: [(float(r["round"]), float(r["eval"][k])) for r in rounds if k in r.get("eval", {})]
             for k in ("loss", "accuracy")}
    out = f'<p class="note">{len(rounds)} round records from {escape(str(run.path))}.</p>'
    if train:
        out += "<h3>Local training loss per center</h3>" + line_svg("run-center-loss", train, "round", "train loss")
    if evals["loss"]:
        out += "<h3>Evaluation of the fused model</h3>" + line_svg(
            "run-eval", {f"eval {k}": v for k, v in evals.items() if v}, "round", "value")
    out += _audit(rounds, run.flagged)
    phases = _phases(run)
    if phases:
        out += ("<h3>Phase times per round (mean over centers; measured)</h3><p class=\"note\">download: round "
                "start to the model at the center (with any wait before the center starts: the in-process engine "
                "runs centers one after another); upload: training done to the update at the server; waiting: "
                "the rest of the round.</p>"
                + stacked_svg("run-phases", [(f"round {r}", list(ph.items())) for r, ph in phases])
                + _table(["round", *phases[0][1]], [[str(r), *(_t(v) for v in ph.values())] for r, ph in phases],
                         "run-phase-table"))
    else:
        out += '<p class="note">No timing records (timing.jsonl) in the run folder: phase times not shown.</p>'
    return out


# -- the page -------------------------------------------------------------------------------------
def _facts(s: Strategy) -> str:
    e = s.estimate
    facts = [("model", f"{s.model.name} ({s.model.params:,} params)"),
             ("cluster", f"{s.cluster.get('name', '?')}, {len(s.mesh.devices)} devices"),
             ("mode", s.mode), ("global batch", str(s.global_batch))]
    if s.mode == "synchronous":
        facts += [("degrees", s.plan.degrees_label()),
                  ("pipeline", f"{s.microbatches} micro-batches, {s.schedule}"),
                  ("memory", f"ZeRO-{s.zero_stage}, recompute {s.recompute}, {s.dtype}")]
    if e:
        facts += [("step", _t(e.step_time_s)), ("throughput", f"{e.samples_per_s:,.1f} samples/s"),
                  ("peak memory", _b(e.memory_bytes_max)), ("exposed communication", f"{100 * e.comm_fraction:.1f}%")]
    return '<div class="facts" id="facts">' + "".join(
        f'<div class="fact">{escape(k)}<b>{escape(v)}</b></div>' for k, v in facts) + "</div>"


def render(strategy: Strategy, run: Run | None = None, title: str | None = None) -> str:
    """The whole page as an HTML string."""
    s = strategy
    head = title or f"{s.model.name} on {s.cluster.get('name', 'a cluster')}"
    parts = [f"<h1>{escape(head)}</h1>", _facts(s), "<h2>Cluster and placement</h2>", cluster_svg(s),
             "<h2>Memory per device</h2>", memory_section(s), "<h2>Step time</h2>", time_section(s)]
    if s.collaborative:
        parts += ["<h2>Round timeline (planned)</h2>", round_plan_section(s)]
    else:
        parts += ["<h2>Pipeline timeline (simulated step)</h2>", pipeline_section(s)]
    if run is not None:
        parts += [f"<h2>Measured run ({run.kind})</h2>",
                  torch_run_section(s, run) if run.kind == "torch" else collab_run_section(run)]
    notes = "".join(f"<li>{escape(n)}</li>" for n in s.search.notes)
    if notes:
        parts.append(f"<h2>Search notes</h2><ul>{notes}</ul>")
    parts.append(f'<p class="note">searched {s.search.candidates} candidates in {s.search.search_s:.2f} s, solver '
                 f"{escape(s.search.solver)}; model fingerprint {escape(s.model.fingerprint)}</p>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(head)}</title>'
            f"<style>{CSS}</style></head><body>" + "\n".join(parts) + "</body></html>\n")
