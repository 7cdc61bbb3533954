"""Translate a Strategy into what torch.distributed can execute, or refuse it with the reason.

The backend runs a plan exactly or not at all. Supported in this slice:

* data parallelism over the ``dp`` mesh axis: DDP when ``zero_stage == 0``, FSDP2 ``fully_shard``
  over the ``dp`` sub-mesh when ``zero_stage >= 1``;
* tensor parallelism over the ``tp`` axis on ``nn.Linear`` modules: a placement splitting the output
  dim ``n`` is ``ColwiseParallel``, one splitting the reduction dim ``k`` (or a factor ``k_0`` of it)
  is ``RowwiseParallel``; a column-parallel linear not followed by a row-parallel one feeds the loss,
  which is then class-parallel (``c:tp`` on cross entropy, run under ``loss_parallel``) or gathered
  to a replicated output when the loss is replicated;
* DP x TP on a 2-D ``("dp", "tp")`` mesh with FSDP2 (``zero_stage >= 1``).

Everything else (pipeline or sequence axes, a tp placement on a module that is not a Linear, such as
head-parallel attention over GPT's fused ``qkv`` projection, vocab-parallel embeddings) is refused:
``parallelize_module`` would either fail or compute something else than the plan priced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from polyparallel.strategy import Strategy

__all__ = ["ExecPlan", "Unsupported", "plan_for"]


class Unsupported(ValueError):
    """The strategy asks for something this backend cannot execute exactly; the message says what."""


@dataclass(frozen=True)
class ExecPlan:
    """What each worker applies. ``tp_plan`` maps module path -> ``"colwise"`` / ``"rowwise"`` /
    ``"colwise_to_loss"`` (column-parallel whose output feeds the loss directly)."""

    dp: int
    tp: int
    data_parallel: str  # "none", "ddp" or "fsdp"
    tp_plan: tuple[tuple[str, str], ...]
    loss_parallel: bool
    global_batch: int


def _parse(placement: str) -> dict[str, tuple[str, ...]]:
    """``"b:dp,n:tp"`` -> ``{"b": ("dp",), "n": ("tp",)}`` (a dim may be split over ``dp+tp``)."""
    out: dict[str, tuple[str, ...]] = {}
    for part in filter(None, (p.strip() for p in placement.split(","))):
        dim, _, axes = part.partition(":")
        out[dim.strip()] = tuple(a for a in re.split(r"[+*]", axes.strip()) if a)
    return out


def _op_index(name: str) -> int:
    """Capture order of an op from its name (``linear`` -> 0, ``linear_7`` -> 7)."""
    m = re.search(r"_(\d+)$", name)
    return int(m.group(1)) if m else 0


def plan_for(strategy: Strategy, model: nn.Module) -> ExecPlan:
    """Check ``strategy`` against ``model`` (built on this process) and return the worker plan.

    Raises :class:`Unsupported` naming the op/module and what to change when any part of the plan
    cannot be expressed with DDP / FSDP2 / ``parallelize_module``.
    """
    s = strategy
    if s.mode != "synchronous":
        raise Unsupported(f"a {s.mode} strategy is run by `polyparallel collab`, not the torch backend")
    if s.pp > 1:
        raise Unsupported(f"pp={s.pp}: pipeline parallelism is not implemented in the torch backend yet; "
                          "search with constraints={'pp': 1}")
    if s.sp > 1:
        raise Unsupported(f"sp={s.sp}: sequence parallelism is not implemented in the torch backend yet; "
                          "search with constraints={'sp': 1}")
    for ax in s.mesh.axes:
        if ax.name not in ("dp", "tp") and ax.size > 1:
            raise Unsupported(f"mesh axis {ax.name!r} of size {ax.size}: only 'dp' and 'tp' axes are executed")
    if s.recompute != "none":
        raise Unsupported(f"recompute={s.recompute!r}: activation recomputation is not executed in this slice; "
                          "search with constraints={'recompute': 'none'}")
    if s.dtype != "fp32":
        raise Unsupported(f"dtype {s.dtype!r}: only fp32 training is executed in this slice")
    if s.global_batch % s.dp:
        raise Unsupported(f"global_batch={s.global_batch} is not divisible by dp={s.dp}")
    if s.microbatches != 1:
        raise Unsupported(f"microbatches={s.microbatches} without pipeline parallelism (gradient accumulation) "
                          "is not executed in this slice")
    modules = dict(model.named_modules())
    linears: list[tuple[int, str, str]] = []  # (capture index, module path, "col"/"row")
    loss_parallel = False
    problems: list[str] = []
    for pl in s.placements:
        dims = _parse(pl.placement)
        for i, op in enumerate(pl.ops):
            path = pl.modules[i] if i < len(pl.modules) else ""
            where = f"op {op!r}" + (f" (module {path!r})" if path else "")
            for dim, axes in dims.items():
                bad = [a for a in axes if a not in ("dp", "tp")]
                if bad:
                    problems.append(f"{where}: placement {pl.placement!r} uses mesh axis {bad[0]!r}")
                    continue
                # the loss sees logits flattened to (batch*seq, classes): its row dim 'n' (or the
                # leading factor 'n_0' canonicalisation split off) carries the batch
                batch_dims = ("b", "n", "n_0") if op.startswith("cross_entropy") else ("b",)
                if "dp" in axes and (dim not in batch_dims or len(axes) > 1):
                    problems.append(f"{where}: placement {pl.placement!r} splits {dim!r} over dp; only the "
                                      "batch dim alone is data-parallel in this backend")
            tp_dims = [d for d, axes in dims.items() if "tp" in axes]
            if not tp_dims or s.tp == 1:
                continue
            if len(tp_dims) > 1:
                problems.append(f"{where}: placement {pl.placement!r} splits several dims over tp")
                continue
            d = tp_dims[0]
            if op.startswith("cross_entropy"):
                if d != "c":
                    problems.append(f"{where}: cross entropy split over {d!r}; only the class dim 'c' is "
                                      "executed (loss_parallel)")
                    continue
                loss_parallel = True
                continue
            mod = modules.get(path) if path else None
            if not isinstance(mod, nn.Linear):
                kind = type(mod).__name__ if mod is not None else "no module"
                hint = (" (head-parallel attention over a fused qkv Linear: ColwiseParallel would give each rank "
                        "a slice of the concatenated [q|k|v], not whole heads)" if "attention" in op else "")
                problems.append(f"{where}: placement {pl.placement!r} splits {d!r} over tp on a {kind}; "
                                  f"only nn.Linear modules are tensor-parallel in this backend{hint}")
                continue
            if d == "n":
                linears.append((_op_index(op), path, "col"))
            elif d == "k" or re.fullmatch(r"k_\d+", d):
                linears.append((_op_index(op), path, "row"))
            else:
                problems.append(f"{where}: placement {pl.placement!r} splits Linear dim {d!r} over tp; "
                                  "only 'n' (column-parallel) and 'k' (row-parallel) are executed")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise Unsupported("the torch backend cannot execute this strategy exactly: " + "; ".join(problems[:5]) + more
                          + ". Search with other constraints (e.g. {'tp': 1}) or change the model")
    linears.sort()
    owners: dict[int, list[str]] = {}
    for name, mod in modules.items():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    for _, path, _ in linears:
        shared = [o for o in owners.get(id(modules[path].weight), []) if o != path]
        if shared:  # e.g. GPT's lm_head tied to the token embedding
            raise Unsupported(f"tensor-parallel Linear {path!r} shares its weight with {shared[0]!r}; sharding a "
                              "tied weight for one module only is not executed in this slice")
    seen: dict[str, str] = {}
    for j, (_, path, kind) in enumerate(linears):
        if path in seen and seen[path] != kind:
            raise Unsupported(f"module {path!r} is called more than once with different tp placements")
        if kind == "col":
            nxt = linears[j + 1][2] if j + 1 < len(linears) else None
            # A column-parallel output is only consumed sharded by a following row-parallel linear
            # (Megatron pairing) or by a class-parallel loss; otherwise it must be gathered.
            kind = "col" if nxt == "row" else ("col_to_loss" if loss_parallel else "col_gather")
            if kind == "col":
                a, b = modules[path], modules[linears[j + 1][1]]
                if a.out_features != b.in_features:  # type: ignore[union-attr]
                    raise Unsupported(f"column-parallel {path!r} ({a.out_features} outputs) is followed by "
                                      f"row-parallel {linears[j + 1][1]!r} ({b.in_features} inputs): not a "
                                      "Megatron pair whose sharded activation passes straight through")
        seen[path] = kind
    if loss_parallel and not any(k == "col_to_loss" for k in seen.values()):
        raise Unsupported("cross entropy is class-parallel over tp but no column-parallel Linear produces its "
                          "logits")
    if s.dp > 1 and s.tp > 1 and s.zero_stage == 0:
        raise Unsupported("dp>1 with tp>1 and zero_stage=0: DDP over DTensor parameters is not executed; "
                          "2-D plans run with FSDP2 (zero_stage>=1)")
    dp_kind = "none" if s.dp == 1 else ("fsdp" if s.zero_stage >= 1 else "ddp")
    return ExecPlan(dp=s.dp, tp=s.tp, data_parallel=dp_kind, tp_plan=tuple(sorted(seen.items())),
                    loss_parallel=loss_parallel, global_batch=s.global_batch)
