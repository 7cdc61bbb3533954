"""Measured vs predicted: the torch backend's step times on this machine against the cost model.

For a small GPT (2 layers, hidden 128, 4 heads, sequence 64, vocabulary 256) and a set of
recipes — one process, DDP, FSDP2, tensor, sequence and pipeline parallelism and their
combinations, at global batches 8 and 16, on 1–4 CPU processes — this benchmark

1. measures this machine with :func:`polyparallel.cost_models.calibrate.calibrate` (what
   ``polyparallel calibrate`` runs), unless ``--no-recalibrate``: the load of a shared machine
   changes within minutes, so the prices are calibrated right before the runs they predict;
2. prices every recipe with ``pp.evaluate(model, cluster, ...)`` on ``local-cpu:<P>`` with the
   workload's ops profiled on this machine first (``profile=True``: measured once per ``P``,
   :mod:`polyparallel.backends.torch.op_timing`), unless ``--no-profile``; each row also keeps the
   calibration-only price;
3. executes it with ``pp.train`` (torch.distributed.run, gloo, one thread per process as the
   backend sets it) for ``--steps`` steps, ``--repeats`` times, recipes interleaved so that a
   slow phase of the machine hits all of them alike; the measured step time is the median of
   rank 0's logged step times after ``--warmup`` warm-up steps of every run;
4. reports per recipe predicted vs measured and the relative error, the Spearman rank
   correlation of predicted vs measured over the executed recipes (target >= 0.9, median |error|
   <= 20%: issue 21), and
   whether ``pp.search``'s choice for the main workload (global batch 8, the fastest
   predicted over ``local-cpu:1/2/4``) runs within 10% of the fastest measured recipe of
   that workload.

A recipe the backend cannot execute is listed as ``refused: <reason>`` (the backend refuses
before launching anything), never dropped. :func:`run_recipes` is shared with
``benchmarks/cost_validation.py --part local`` (an MLP through the same backend).

    .venv/bin/python benchmarks/executor.py --calibration /tmp/cal.json  # calibration + 3 x 14 runs + search
    .venv/bin/python benchmarks/executor.py --no-recalibrate  # reuse the calibration file
    .venv/bin/python benchmarks/executor.py --components      # one process, parts of a step (~2 min)

``--components`` also checks the validation MLP of ``benchmarks/cost_validation.py`` in one
process: compute (skinny GEMMs of 8 and 2 rows, gradient accumulation over 4 micro-batches) and
Adam's step, priced from rates measured seconds before, with and without those terms.

On 2 idle cores a launch takes ~5 s, so the whole benchmark takes about 4-5 minutes; with other
work on the cores (load 15) each launch took 30-40 s and the benchmark 20 minutes, and the step
times moved by up to 2x between repeats: read such a run's table as indicative only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).parent / "results" / "executor.json"
COMPONENTS_OUT = Path(__file__).parent / "results" / "executor_components.json"
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the workers import this module by name to build the model
    sys.path.insert(0, str(HERE))

__all__ = ["FRAMEWORK_TERMS", "GPT", "MLP", "MLP_TERMS", "Recipe", "Workload", "calibrate_now", "component_check",
           "gpt_data", "gpt_model", "mlp_component_check", "mlp_data", "mlp_model", "print_table", "run_recipes",
           "search_check", "spearman"]

# --------------------------------------------------------------------------------------------
# workloads: model and data functions the workers import as "executor:<name>"
# --------------------------------------------------------------------------------------------

GPT_SHAPE = {"vocab": 256, "seq": 64, "layers": 2, "hidden": 128, "heads": 4}


def gpt_model() -> torch.nn.Module:
    from polyparallel.models import GPT, GPTConfig

    return GPT(GPTConfig(**GPT_SHAPE))


def gpt_data(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)  # the same global batch on every rank
    ids = torch.randint(0, GPT_SHAPE["vocab"], (batch, GPT_SHAPE["seq"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class Workload:
    """A model and its data, as ``"module:function"`` names the workers can import.

    ``data`` is called as ``data(step, batch)`` and returns the global batch ``(inputs, labels)``.
    """

    name: str
    model: str
    data: str
    description: str

    def model_fn(self) -> Callable[[], torch.nn.Module]:
        return _resolve(self.model)

    def data_fn(self, batch: int) -> Callable[[int], Any]:
        # a partial of a module-level function pickles by reference: the workers rebuild it
        return functools.partial(_resolve(self.data), batch=batch)


GPT = Workload("gpt", "executor:gpt_model", "executor:gpt_data",
               "GPT {layers} layers, hidden {hidden}, {heads} heads, seq {seq}, vocab {vocab} (tied), Adam, fp32"
               .format(**GPT_SHAPE))

MLP_DIMS = (1024,) * 7  # six Linear(1024, 1024) + ReLU, 1024 classes: three Megatron column/row pairs


def mlp_model() -> torch.nn.Module:
    from polyparallel.models import MLP

    return MLP(MLP_DIMS)


def mlp_data(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8000 + step)
    return torch.randn(batch, MLP_DIMS[0], generator=g), torch.randint(0, MLP_DIMS[-1], (batch,), generator=g)


MLP = Workload("mlp", "executor:mlp_model", "executor:mlp_data",
               f"MLP {len(MLP_DIMS) - 1} x Linear({MLP_DIMS[0]}, {MLP_DIMS[0]}) + ReLU + cross-entropy, Adam, fp32")


def _resolve(name: str) -> Any:
    mod, _, fn = name.partition(":")
    return getattr(importlib.import_module(mod), fn)


@dataclass(frozen=True)
class Recipe:
    """One way to run a workload: parallel degrees, ZeRO stage, global batch, micro-batches.

    ``zero_stage >= 1`` runs as FSDP2 ``fully_shard`` in the backend, which shards the
    parameters too: it is priced as what runs, ZeRO-3.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    zero_stage: int = 0
    batch: int = 8
    microbatches: int = 1
    schedule: str | None = None
    sequence_parallel: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("sp", self.sp)) if v > 1]
        parts = parts or ["single"]
        if self.zero_stage:
            parts.append("fsdp")
        if self.pp > 1 or self.microbatches > 1:
            parts.append(f"m{self.microbatches}" + (f"-{self.schedule}" if self.schedule else ""))
        if self.sequence_parallel:
            parts.append("seqpar")
        return " ".join(parts) + f" B={self.batch}"

    def evaluate_kwargs(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "sp": self.sp, "zero_stage": self.zero_stage,
                "microbatches": self.microbatches, "schedule": self.schedule, "batch_size": self.batch}


GPT_RECIPES = (
    Recipe(batch=4),
    Recipe(dp=2, batch=4),
    Recipe(batch=8),
    Recipe(dp=2, batch=8),
    Recipe(dp=2, zero_stage=3, batch=8),
    Recipe(tp=2, batch=8),
    Recipe(dp=2, tp=2, zero_stage=3, batch=8),
    Recipe(pp=2, microbatches=4, schedule="1f1b", batch=8),
    Recipe(pp=2, microbatches=4, schedule="gpipe", batch=8),
    Recipe(sp=2, batch=8),
    Recipe(dp=2, batch=16),
    Recipe(dp=4, batch=16),
    Recipe(dp=4, zero_stage=3, batch=16),
    Recipe(dp=2, pp=2, microbatches=2, schedule="1f1b", batch=16),
)
MAIN_BATCH = 8  # the workload whose fastest recipe the search must find

# --------------------------------------------------------------------------------------------
# measuring and pricing
# --------------------------------------------------------------------------------------------


def calibrate_now(say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure this machine into the default calibration file (what ``polyparallel calibrate`` does)."""
    from polyparallel.cluster import default_calibration_path
    from polyparallel.cost_models.calibrate import calibrate

    path = default_calibration_path()
    say(f"calibrating this machine -> {path}")
    t0 = time.perf_counter()
    cal = calibrate(path)
    say(f"  calibrated in {time.perf_counter() - t0:.0f} s")
    return cal


def _example(workload: Workload) -> tuple[Any, ...]:
    x, y = workload.data_fn(2)(0)
    return (x, y)


_PROFILED: dict[tuple[str, int], Any] = {}


def _cluster(workload: Workload, model: torch.nn.Module, world: int, profile: bool) -> Any:
    """``local-cpu:<world>``, with the workload's ops measured on it when ``profile`` (once per world)."""
    from polyparallel.backends.torch.op_timing import profiled_cluster
    from polyparallel.cluster import Cluster
    from polyparallel.planning.model_graphs import ModelGraphs

    cl = Cluster.preset(f"local-cpu:{world}")
    if not profile:
        return cl
    if (workload.name, world) not in _PROFILED:
        _PROFILED[workload.name, world], _ = _retaken_while_stolen(
            lambda: profiled_cluster(cl, ModelGraphs(model, _example(workload), None)), 2,
            lambda steal: print(f"  profiling for {world} process(es): the hypervisor took {100 * steal:.0f}% of "
                                "the CPU time: again"))
    return _PROFILED[workload.name, world]


def _retaken_while_stolen(fn: Callable[[], Any], retries: int, again: Callable[[float], None]) -> tuple[Any, float]:
    """``fn()``, called again (up to ``retries`` times, ``again(share)`` said before each) while the
    hypervisor took more than ``STOLEN`` of the CPU time during it (a virtual machine's neighbours:
    the same run took 2-3x as long); the last result and the share stolen during it."""
    from polyparallel.cost_models.machine_load import STOLEN, cpu_clock, stolen_since

    for attempt in range(retries + 1):
        clock = cpu_clock()
        out = fn()
        steal = stolen_since(clock)
        if steal <= STOLEN or attempt == retries:
            break
        again(steal)
    return out, steal


def _price(workload: Workload, recipe: Recipe, model: torch.nn.Module, profile: bool = False) -> Any:
    import polyparallel as pp

    kw = {k: v for k, v in recipe.evaluate_kwargs().items() if v is not None}
    return pp.evaluate(model, _example(workload), _cluster(workload, model, recipe.world, profile), **kw)


def _train(workload: Workload, strategy: Any, batch: int, steps: int) -> list[float]:
    import polyparallel as pp

    # one intra-op thread per process, as the calibration measured (and as pp.train defaults to)
    os.environ["OMP_NUM_THREADS"] = "1"
    log = pp.train(strategy, workload.model, workload.data_fn(batch), steps=steps, optimizer="adam", lr=1e-3,
                   timeout_s=300)
    return [float(r["step_time_s"]) for r in sorted(log, key=lambda r: r["step"])]


def run_recipes(workload: Workload, recipes: Sequence[Recipe], *, steps: int, warmup: int, repeats: int,
                say: Callable[[str], None] = print, profile: bool = False,
                retry_stolen: int = 2) -> list[dict[str, Any]]:
    """Price and execute every recipe; one row per recipe (measured, predicted, error or why not).

    ``profile``: price from the workload's ops measured on this machine (``evaluate(...,
    profile=True)``); each row also keeps the calibration-only price (``calibration_only_s``).
    A run the hypervisor took CPU time from is run again, up to ``retry_stolen`` times
    (:func:`_retaken_while_stolen`); each row keeps the stolen share of the runs it kept (``steal``)."""
    from polyparallel.backends.torch import Unsupported

    model = workload.model_fn()()
    rows: list[dict[str, Any]] = []
    strategies: dict[int, Any] = {}
    for i, r in enumerate(recipes):
        row: dict[str, Any] = {"recipe": r.name, **asdict(r), "world": r.world}
        try:
            s = _price(workload, r, model, profile)
            plain = _price(workload, r, model) if profile else s
        except (ValueError, RuntimeError) as e:  # the cost model cannot price it (e.g. it does not divide)
            row["status"] = f"not priced: {str(e).splitlines()[0]}"
        else:
            row.update(predicted_s=s.estimate.step_time_s, predicted_breakdown_s={
                k: v for k, v in s.estimate.breakdown.items() if v}, calibration_only_s=plain.estimate.step_time_s)
            if s.search.notes:
                row["notes"] = s.search.notes
            strategies[i] = s
        rows.append(row)
    times: dict[int, list[float]] = {i: [] for i in strategies}
    for rep in range(repeats):
        for i, s in strategies.items():
            row = rows[i]
            if "status" in row:
                continue
            t0 = time.perf_counter()
            try:
                head = f"  run {rep + 1}/{repeats} {row['recipe']:<28}"
                ts, steal = _retaken_while_stolen(
                    lambda s=s, b=recipes[i].batch: _train(workload, s, b, steps), retry_stolen,
                    lambda steal, head=head: say(f"{head} the hypervisor took {100 * steal:.0f}% of the CPU time "
                                                 "(other virtual machines): run again"))
                row.setdefault("steal", []).append(round(steal, 4))
            except Unsupported as e:
                row["status"] = f"refused: {e}"
                say(f"  {row['recipe']:<28} refused: {str(e)[:150]}")
                continue
            except Exception as e:  # a failed run is reported with its reason, the others go on
                row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                # a worker killed by a signal leaves only the launcher's output (with the faulthandler
                # stack of the dying rank): keep its tail to find the cause of rare crashes
                row["failure_output"] = str(e)[-4000:]
                say(f"  {row['recipe']:<28} {row['status']}")
                continue
            times[i] += ts[warmup:]
            say(f"  run {rep + 1}/{repeats} {row['recipe']:<28} median step {1e3 * statistics.median(ts[warmup:]):7.1f}"
                f" ms  ({time.perf_counter() - t0:.0f} s with launch)")
    for i, ts in times.items():
        row = rows[i]
        if ts and "status" not in row:
            row.update(status="ok", measured_s=statistics.median(ts), measured_steps=len(ts),
                       measured_min_s=min(ts), measured_max_s=max(ts))
            row["error"] = row["predicted_s"] / row["measured_s"] - 1
            row["calibration_only_error"] = row["calibration_only_s"] / row["measured_s"] - 1
    return rows


def spearman(rows: Sequence[dict[str, Any]]) -> float | None:
    """Spearman rank correlation of predicted vs measured over the executed rows."""
    from scipy.stats import spearmanr

    ok = [r for r in rows if r.get("status") == "ok"]
    if len(ok) < 3:
        return None
    return float(spearmanr([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]).statistic)


def search_check(workload: Workload, rows: list[dict[str, Any]], batch: int, procs: Sequence[int], *,
                 steps: int, warmup: int, repeats: int, say: Callable[[str], None] = print,
                 profile: bool = False) -> dict[str, Any]:
    """``pp.search`` on ``local-cpu:P`` for each ``P``; the fastest predicted is the planner's choice.

    Its measured step time (from the matching recipe's row, or run here) is compared with the
    fastest measured recipe of the same workload (global ``batch``).
    """
    import polyparallel as pp

    model = workload.model_fn()()
    picks = []
    for p in procs:
        try:
            s = pp.search(model, _example(workload), _cluster(workload, model, p, profile), batch_size=batch)
        except ValueError as e:
            picks.append({"procs": p, "status": f"no plan: {e}"})
            continue
        r = Recipe(dp=s.dp, tp=s.tp, pp=s.pp, sp=s.sp, zero_stage=s.zero_stage, batch=batch,
                   microbatches=s.microbatches, schedule=s.schedule if s.pp > 1 else None)
        picks.append({"procs": p, "recipe": r, "predicted_s": s.estimate.step_time_s})
    priced = [c for c in picks if "predicted_s" in c]
    out: dict[str, Any] = {"batch": batch, "candidates": [
        {**{k: v for k, v in c.items() if k != "recipe"}, **({"recipe": c["recipe"].name} if "recipe" in c else {})}
        for c in picks]}
    if not priced:
        return {**out, "status": "the search found no plan"}
    choice = min(priced, key=lambda c: c["predicted_s"])
    r = choice["recipe"]
    same = [x for x in rows if x["recipe"] == r.name and x.get("status") == "ok"]
    if same:
        measured = same[0]["measured_s"]
    else:
        say(f"  the search's choice {r.name} is not among the recipes: running it")
        extra = run_recipes(workload, [r], steps=steps, warmup=warmup, repeats=repeats, say=say, profile=profile)[0]
        if extra.get("status") != "ok":
            return {**out, "choice": r.name, "status": extra.get("status")}
        measured = extra["measured_s"]
    best = min((x for x in rows if x.get("status") == "ok" and x["batch"] == batch), key=lambda x: x["measured_s"])
    ratio = measured / best["measured_s"]
    return {**out, "status": "ok", "choice": r.name, "choice_predicted_s": choice["predicted_s"],
            "choice_measured_s": measured, "fastest_measured": best["recipe"],
            "fastest_measured_s": best["measured_s"], "choice_over_fastest": ratio, "within_10pct": ratio <= 1.10}


def _measure_parts(batch: int, steps: int) -> list[float]:
    """Median forward, backward and optimizer seconds of single-process GPT steps in this process."""
    model = gpt_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # as the backend builds it on a CPU
    parts = []
    for i in range(steps):
        x, y = gpt_data(i, batch)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return [statistics.median(c) for c in zip(*parts[3:], strict=True)]


@contextlib.contextmanager
def _one_process_cluster(rates: dict[str, Any]) -> Iterator[Any]:
    """``local-cpu:1`` priced from one process's measured ``rates`` (a temporary calibration file in
    ``POLYPARALLEL_CALIBRATION``, restored afterwards)."""
    import tempfile

    from polyparallel.cluster import Cluster

    cal = {"cores": os.cpu_count() or 1, "threads_per_process": 1, "matmul": {"1": rates["matmul"]},
           "memory_bandwidth": rates["memory_bandwidth"], "per_processes": {"1": rates}}
    prev = os.environ.get("POLYPARALLEL_CALIBRATION")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cal.json").write_text(json.dumps(cal))
        os.environ["POLYPARALLEL_CALIBRATION"] = str(Path(d) / "cal.json")
        try:
            yield Cluster.preset("local-cpu:1")
        finally:
            if prev is None:
                os.environ.pop("POLYPARALLEL_CALIBRATION", None)
            else:
                os.environ["POLYPARALLEL_CALIBRATION"] = prev


def _price_parts(rates: dict[str, Any], batch: int) -> list[float]:
    """Priced forward, backward and optimizer seconds of a single-process GPT step under one process's ``rates``."""
    from polyparallel.cost_models import ParallelConfig, estimate_step
    from polyparallel.cost_models.compute import op_cost
    from polyparallel.planning.model_graphs import ModelGraphs

    with _one_process_cluster(rates) as cl:
        g = ModelGraphs(gpt_model(), _example(GPT), None).graph(batch)
        costs = [op_cost(g, op, cl.device(0).type) for op in g.ops]
        opt = estimate_step(g, cl, ParallelConfig(optimizer="adam")).breakdown()["optimizer"]
    return [sum(c.forward for c in costs), sum(c.backward for c in costs), opt]


# the CPU framework terms of the calibration; "without" prices as before they were measured
FRAMEWORK_TERMS = ("training_op_overhead", "attention", "optimizer_tensor_overhead")


def component_check(batches: Sequence[int] = (4, 8), rounds: int = 3, steps: int = 12,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """Forward, backward and optimizer time of a one-process GPT step: priced vs measured, no launch.

    In this process, on one thread (as a worker), each round measures the calibration's
    per-process rates (:func:`polyparallel.cost_models.calibrate.kernel_rates`, attention rows
    included) and right after them the step's parts; medians over rounds. Each step is priced
    with all the measured terms and without the CPU framework terms (:data:`FRAMEWORK_TERMS`), so
    the table shows what they account for, part by part, on the same measurements. Nothing is
    launched, so a shared machine disturbs this less than the multi-process runs.
    """
    from polyparallel.cost_models.calibrate import ATTENTION_SHAPES, kernel_rates

    torch.set_num_threads(1)
    got: dict[int, list[tuple[list[float], list[float], list[float]]]] = {b: [] for b in batches}
    for _ in range(rounds):
        rates = kernel_rates((32, 64, 128, 256, 512), attention_shapes=ATTENTION_SHAPES)
        without = {k: v for k, v in rates.items() if k not in FRAMEWORK_TERMS}
        # every measurement before any pricing: measured right after the B=4 pricing (a capture
        # with torch.export), B=8's optimizer steps took 6.0 ms instead of 2.0 (cause not found);
        # a training worker never captures
        measured = {b: _measure_parts(b, steps) for b in batches}
        for b in batches:
            got[b].append((measured[b], _price_parts(rates, b), _price_parts(without, b)))
    out = []
    say(f"  {'batch':>5} {'part':<10} {'measured':>9} {'priced':>9} {'error':>7} {'without':>9} {'error':>7}")
    for b, rs in got.items():
        for i, part in enumerate(("forward", "backward", "optimizer", "total")):
            def med(j: int, i: int = i, rs: list = rs) -> float:
                return statistics.median(sum(r[j]) if i == 3 else r[j][i] for r in rs)
            m, new, old = med(0), med(1), med(2)
            out.append({"batch": b, "part": part, "measured_s": m, "predicted_s": new, "error": new / m - 1,
                        "predicted_without_framework_terms_s": old, "error_without": old / m - 1})
            say(f"  {b:>5} {part:<10} {1e3 * m:7.2f}ms {1e3 * new:7.2f}ms {100 * (new / m - 1):+6.1f}% "
                f"{1e3 * old:7.2f}ms {100 * (old / m - 1):+6.1f}%")
    return {"rows": out, "rounds": rounds, "steps": steps, "load_average": os.getloadavg()[0]}


def _measure_mlp(batch: int, microbatches: int, steps: int) -> list[float]:
    """Median seconds of the forward + backward of all micro-batches, and of the optimizer step, of
    one-process MLP steps in this process (the gradient accumulates over the micro-batches)."""
    model = mlp_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # as the backend builds it on a CPU
    mb = batch // microbatches
    parts = []
    for i in range(steps):
        x, y = mlp_data(i, batch)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for j in range(microbatches):
            model(x[j * mb:(j + 1) * mb], y[j * mb:(j + 1) * mb]).backward()
        t1 = time.perf_counter()
        opt.step()
        parts.append((t1 - t0, time.perf_counter() - t1))
    return [statistics.median(c) for c in zip(*parts[3:], strict=True)]


def _price_mlp(rates: dict[str, Any], batch: int, microbatches: int) -> list[float]:
    """Priced compute (forward + backward of every micro-batch) and optimizer seconds of a one-process
    MLP step under one process's ``rates``."""
    from polyparallel.cost_models import ParallelConfig, estimate_step
    from polyparallel.planning.model_graphs import ModelGraphs

    with _one_process_cluster(rates) as cl:
        g = ModelGraphs(mlp_model(), _example(MLP), None).graph(batch // microbatches)
        b = estimate_step(g, cl, ParallelConfig(optimizer="adam", microbatches=microbatches)).breakdown()
    return [b["compute"], b["optimizer"]]


# the CPU terms of this session's calibration: skinny GEMMs, optimizer per element, gradient accumulation
MLP_TERMS = ("gemm", "optimizer_element", "grad_accumulation")


def mlp_component_check(cases: Sequence[tuple[int, int]] = ((8, 1), (8, 4)), rounds: int = 3, steps: int = 10,
                        say: Callable[[str], None] = print) -> dict[str, Any]:
    """The validation MLP's one-process step, compute and optimizer: priced vs measured, no launch.

    As :func:`component_check`: each round measures the calibration's per-process rates
    (:func:`polyparallel.cost_models.calibrate.kernel_rates`) and right after them the step's parts
    for each ``(global batch, micro-batches)`` case; medians over rounds. Priced with all the
    measured terms and without :data:`MLP_TERMS` (as before they were measured), on the same rates.
    """
    from polyparallel.cost_models.calibrate import kernel_rates

    torch.set_num_threads(1)
    got: dict[tuple[int, int], list[tuple[list[float], list[float], list[float]]]] = {c: [] for c in cases}
    for _ in range(rounds):
        rates = kernel_rates((32, 64, 128, 256, 512))
        without = {k: v for k, v in rates.items() if k not in MLP_TERMS}
        measured = {c: _measure_mlp(*c, steps) for c in cases}
        for c in cases:
            got[c].append((measured[c], _price_mlp(rates, *c), _price_mlp(without, *c)))
    out = []
    say(f"  {'batch':>5} {'m':>2} {'part':<10} {'measured':>9} {'priced':>9} {'error':>7} {'without':>9} {'error':>7}")
    for (b, m), rs in got.items():
        for i, part in enumerate(("compute", "optimizer", "total")):
            def med(j: int, i: int = i, rs: list = rs) -> float:
                return statistics.median(sum(r[j]) if i == 2 else r[j][i] for r in rs)
            ms, new, old = med(0), med(1), med(2)
            out.append({"batch": b, "microbatches": m, "part": part, "measured_s": ms, "predicted_s": new,
                        "error": new / ms - 1, "predicted_without_new_terms_s": old, "error_without": old / ms - 1})
            say(f"  {b:>5} {m:>2} {part:<10} {1e3 * ms:7.2f}ms {1e3 * new:7.2f}ms {100 * (new / ms - 1):+6.1f}% "
                f"{1e3 * old:7.2f}ms {100 * (old / ms - 1):+6.1f}%")
    return {"rows": out, "rounds": rounds, "steps": steps, "load_average": os.getloadavg()[0]}


def print_table(rows: Sequence[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    say(f"  {'recipe':<28} {'P':>2} {'predicted':>10} {'measured':>10} {'error':>8} {'calib. only':>11} {'error':>8}")
    for r in rows:
        if r.get("status") == "ok":
            cal = (f" {1e3 * r['calibration_only_s']:9.1f}ms {100 * r['calibration_only_error']:+7.1f}%"
                   if "calibration_only_error" in r else "")
            say(f"  {r['recipe']:<28} {r['world']:>2} {1e3 * r['predicted_s']:8.1f}ms {1e3 * r['measured_s']:8.1f}ms "
                f"{100 * r['error']:+7.1f}%{cal}")
        else:
            pred = f"{1e3 * r['predicted_s']:8.1f}ms" if "predicted_s" in r else f"{'-':>10}"
            say(f"  {r['recipe']:<28} {r['world']:>2} {pred} {r.get('status', '?')[:150]}")


def _calibration_summary(path: Path) -> dict[str, Any]:
    cal = json.loads(path.read_text())
    fits = cal.get("collectives", {}).get("fit_by_group_size", {})
    return {"path": str(path), "date": cal.get("date"), "cores": cal.get("cores"),
            "threads_per_process": cal.get("threads_per_process"), "load_average": cal.get("load_average"),
            "other_work": cal.get("other_work"), "warnings": cal.get("warnings"),
            "gloo_by_group_size": {p: {"alpha_s": f["alpha"], "bandwidth_Bps": f["bandwidth"]}
                                   for p, f in fits.items()},
            "matmul_peak_flops_by_procs": {p: max(r["flops"] / r["seconds"] for r in k["matmul"])
                                           for p, k in cal.get("per_processes", {}).items()},
            # the framework terms priced on CPU processes (absent from calibrations older than them)
            "training_op_overhead_s_by_procs": {p: k.get("training_op_overhead")
                                                for p, k in cal.get("per_processes", {}).items()},
            "optimizer_tensor_overhead_s_by_procs": {p: k.get("optimizer_tensor_overhead")
                                                     for p, k in cal.get("per_processes", {}).items()},
            "attention_forward_backward_flops_by_procs": {
                p: [[r["shape"], r["flops"] / r["forward_s"], r["flops"] / r["backward_s"] if r["backward_s"] else None]
                    for r in k.get("attention", [])] for p, k in cal.get("per_processes", {}).items()}}


def _profile_sources() -> dict[str, str]:
    """What each world's profile measured (its device's source, the link's), for the JSON."""
    out = {}
    for (name, world), cl in _PROFILED.items():
        node = cl.nodes[0]
        out[f"{name}/{world}"] = f"{cl.device(0).type.source}; link: {node.intra.source if node.intra else 'none'}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps per run (warm-up included)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps of every run left out")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every recipe (interleaved)")
    ap.add_argument("--no-recalibrate", action="store_true", help="use the existing calibration file")
    ap.add_argument("--components", action="store_true",
                    help="only the one-process check: forward/backward/optimizer priced vs measured (~1 min)")
    ap.add_argument("--no-profile", action="store_true",
                    help="price from the calibration alone, without measuring the workload's ops first")
    ap.add_argument("--calibration", metavar="FILE",
                    help="the calibration file to write (unless --no-recalibrate) and price with; default "
                         "$POLYPARALLEL_CALIBRATION, else ~/.cache/polyparallel/calibration.json")
    args = ap.parse_args()
    if args.calibration:  # the pricing and every worker read it from the environment
        os.environ["POLYPARALLEL_CALIBRATION"] = str(Path(args.calibration).resolve())
    if args.components:
        print(f"{GPT.description}; one process, one thread: parts of a step, priced vs measured "
              f"(without: as priced before the CPU framework terms {', '.join(FRAMEWORK_TERMS)}):")
        res = {"workload": GPT.description, "command": "python benchmarks/executor.py --components",
               "load_average_start": os.getloadavg()[0], **component_check()}
        print(f"{MLP.description}; one process, one thread, micro-batches accumulating (without: as priced "
              f"before {', '.join(MLP_TERMS)}):")
        res["mlp"] = {"workload": MLP.description, **mlp_component_check()}
        COMPONENTS_OUT.write_text(json.dumps(res, indent=1))
        print(f"wrote {COMPONENTS_OUT}")
        return
    from polyparallel.cluster import default_calibration_path

    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    from polyparallel.cost_models.machine_load import cpu_clock, other_work

    clock = cpu_clock()
    if not args.no_recalibrate or not default_calibration_path().is_file():
        calibrate_now()
    print(f"{GPT.description}; {args.repeats} x {args.steps} steps per recipe, first {args.warmup} left out:")
    profile = not args.no_profile
    rows = run_recipes(GPT, GPT_RECIPES, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                       profile=profile)
    rho = spearman(rows)
    print("search (pp.search on local-cpu:1, 2, 4; the fastest predicted is the choice):")
    check = search_check(GPT, rows, MAIN_BATCH, (1, 2, 4), steps=args.steps, warmup=args.warmup,
                         repeats=args.repeats, profile=profile)
    print_table(rows)
    ok = [r for r in rows if r.get("status") == "ok"]
    med = statistics.median(abs(r["error"]) for r in ok) if ok else None
    med_cal = statistics.median(abs(r["calibration_only_error"]) for r in ok) if ok else None
    rho_cal = spearman([{**r, "predicted_s": r["calibration_only_s"]} for r in ok])
    print(f"  Spearman (predicted vs measured, {len(ok)} executed recipes): "
          f"{'n/a' if rho is None else f'{rho:.3f}'} (target >= 0.9); median |error| "
          f"{'n/a' if med is None else f'{100 * med:.0f}%'} (target <= 20%)")
    if profile and ok:
        print(f"  priced from the calibration alone: Spearman {'n/a' if rho_cal is None else f'{rho_cal:.3f}'}, "
              f"median |error| {100 * med_cal:.0f}%")
    if check.get("status") == "ok":
        print(f"  search's choice {check['choice']}: measured {1e3 * check['choice_measured_s']:.1f} ms; "
              f"fastest measured {check['fastest_measured']} {1e3 * check['fastest_measured_s']:.1f} ms -> "
              f"x{check['choice_over_fastest']:.2f} ({'within' if check['within_10pct'] else 'NOT within'} 10%)")
    else:
        print(f"  search check: {check.get('status')}")
    result = {
        "workload": GPT.description, "host": {"machine": platform.machine(), "cores": os.cpu_count(),
                                              "load_average_start": load0, "load_average_end": os.getloadavg()[0]},
        "command": "python benchmarks/executor.py " + " ".join(sys.argv[1:]),
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "measured": "median over runs of rank 0's logged step times after warm-up",
        "calibration": _calibration_summary(default_calibration_path()),
        "profiled": profile, "profiles": _profile_sources(),
        "other_work": other_work(clock, cpu_clock(), os.cpu_count() or 1),
        "rows": rows, "spearman": rho, "median_abs_error": med,
        "calibration_only": {"spearman": rho_cal, "median_abs_error": med_cal}, "executed": len(ok), "search": check,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1, default=str))
    share = result["other_work"]
    if share:
        print(f"  meanwhile other processes kept {share['others']:.2f} cores busy and the hypervisor took "
              f"{100 * share['steal']:.1f}% of the CPU time (other virtual machines)")
    print(f"wrote {OUT} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
