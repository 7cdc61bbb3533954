"""Checkpoints of the torch backend: save and resume on the workers, keep the last k, and check
before launch that a checkpoint can be resumed under the strategy given.

A checkpoint folder holds ``step-N/`` (one torch.distributed.checkpoint save after step N, with
``strategy.json``, the strategy that wrote it) and ``LATEST`` (the N to resume from). DCP stores
tensors by fully-qualified parameter name and reshards on load (DTensor / FSDP shards, replicated
DDP tensors), so a checkpoint written without pipeline stages loads under any other data/tensor
parallel layout. Pipeline ranks save their optimiser under per-stage keys (``optim.stage{k}``),
which only the same pipeline layout can read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from polyparallel.strategy import Strategy

__all__ = ["check_resume", "latest", "prune", "resume", "save_checkpoint", "trim_log"]

STRATEGY_FILE = "strategy.json"


def latest(ckpt: Path | None) -> int | None:
    """The step of the checkpoint to resume from, or None."""
    if ckpt is None or not (ckpt / "LATEST").exists():
        return None
    return int((ckpt / "LATEST").read_text())


def trim_log(log: Path, done: int) -> None:
    """Drop the lines of ``log`` (train.jsonl) after step ``done``: those steps are run again."""
    if log.exists():
        kept = [line for line in log.read_text().splitlines() if line and json.loads(line)["step"] <= done]
        tmp = log.with_name(f".{log.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, log)


def prune(ckpt: Path, keep: int | None) -> list[int]:
    """Remove ``step-N`` folders older than the ``keep`` newest up to ``LATEST`` (the one LATEST
    names is always kept; folders after it, a save interrupted by a kill, are left to be overwritten).
    Returns the steps removed."""
    done = latest(ckpt)
    if keep is None or done is None:
        return []
    older = sorted((int(p.name[5:]) for p in ckpt.glob("step-*") if p.name[5:].isdigit() and int(p.name[5:]) < done),
                   reverse=True)
    gone = older[max(keep - 1, 0):]
    for n in gone:
        shutil.rmtree(ckpt / f"step-{n}", ignore_errors=True)
    return gone


def save_checkpoint(ckpt: Path, step: int, model: Any, opt: Any, rank: int, optim_key: str = "optim",
                    job: dict[str, Any] | None = None) -> None:
    """Save model and optimiser (sharded as they are) with torch.distributed.checkpoint after ``step``.

    ``LATEST`` is rewritten (atomically, by rank 0) only after every rank finished writing, so a
    kill mid-save leaves the previous checkpoint as the one to resume from. From ``job`` (the
    launcher's job): ``strategy_json`` is stored in the step's folder, and rank 0 then keeps only the
    ``keep_checkpoints`` newest folders (:func:`prune`).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    job = job or {}
    msd, osd = get_state_dict(model, opt)
    folder = ckpt / f"step-{step}"
    dcp.save({"model": msd, optim_key: osd}, checkpoint_id=str(folder))
    if rank == 0 and job.get("strategy_json"):
        (folder / STRATEGY_FILE).write_text(job["strategy_json"])
    dist.barrier()
    if rank == 0:
        tmp = ckpt / ".LATEST.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, ckpt / "LATEST")
        prune(ckpt, job.get("keep_checkpoints"))


def resume(ckpt: Path | None, model: Any, opt: Any, log: Path | None, optim_key: str = "optim") -> int:
    """Load the latest checkpoint if there is one (resharded to this rank's layout); return the
    first step still to run. Rank 0 (``log`` given) also drops log lines of later steps."""
    done = latest(ckpt)
    if done is None:
        return 0
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, optim_key: osd}
    dcp.load(state, checkpoint_id=str(ckpt / f"step-{done}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state[optim_key])
    if log is not None:
        trim_log(log, done)
    return done + 1


def _layout(s: Any) -> str:
    text = f"dp={s.dp} tp={s.tp} sp={s.sp} pp={s.pp} zero_stage={s.zero_stage}"
    if s.pp > 1:
        text += f" microbatches={s.microbatches} schedule={s.schedule} stages={[st.ops for st in s.stages]}"
    return text


def _micro_batch(s: Any) -> int:
    return s.global_batch // (s.dp * s.microbatches)


def _check_parameters(where: Path, model: Any) -> None:
    """The checkpoint's model tensors must be the model's, by name and shape (what DCP loads by)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    saved = {k[6:]: tuple(v.size) for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}
    have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [f"{k} missing" for k in have if k not in saved] + [f"{k} not in the model" for k in saved if k not in have]
    wrong += [f"{k} is {list(saved[k])} there, {list(have[k])} here" for k in have
              if k in saved and saved[k] != have[k]]
    if wrong:
        raise ValueError(f"the checkpoint in {where} is not of this model ({len(wrong)} tensors differ: "
                         f"{'; '.join(wrong[:3])}): resume with the model that wrote it, or train in a new run "
                         "directory / checkpoint_dir")


def check_resume(ckpt: Path, strategy: Any, model: Any = None) -> int | None:
    """Before launch: the step a run under ``strategy`` resumes from in ``ckpt`` (None: a fresh
    start), or ValueError when that checkpoint cannot be loaded under it: another model (its
    strategy's fingerprint, comparable at the same micro-batch size, or the parameter names and
    shapes of ``model`` against the checkpoint's), or a pipeline layout that differs from the
    checkpoint's."""
    done = latest(ckpt)
    if done is None:
        return None
    where = ckpt / f"step-{done}"
    if not where.is_dir():
        raise ValueError(f"{ckpt}/LATEST names step {done}, but {where} is missing: remove {ckpt / 'LATEST'} to "
                         "start afresh, or point LATEST at an existing step-N folder")
    saved = Strategy.from_json(where / STRATEGY_FILE) if (where / STRATEGY_FILE).exists() else None
    # a fingerprint covers the graph at the micro-batch size it was captured at
    if saved is not None and _micro_batch(saved) == _micro_batch(strategy) \
            and saved.model.fingerprint != strategy.model.fingerprint:
        raise ValueError(f"the checkpoint in {where} is of model {saved.model.name!r} (fingerprint "
                         f"{saved.model.fingerprint}), not of this strategy's {strategy.model.name!r} "
                         f"({strategy.model.fingerprint}): resume it with its own strategy ({where / STRATEGY_FILE}), "
                         "or train in a new run directory / checkpoint_dir")
    if model is not None and strategy.pp == 1 and (saved is None or saved.pp == 1):
        _check_parameters(where, model)  # pipeline ranks save their chunks' tensors under the chunks' names
    if saved is None:  # written by a version that did not record its strategy
        return done
    old, new = _layout(saved), _layout(strategy)
    if old != new and (saved.pp > 1 or strategy.pp > 1):
        raise ValueError(f"the checkpoint in {where} was written by layout [{old}] and cannot be resharded to "
                         f"[{new}]: a pipeline run saves and loads its optimiser under per-stage keys, so only the "
                         f"same pipeline layout can resume it. Resume with the saved strategy "
                         f"({where / STRATEGY_FILE}), or start in a new run directory / checkpoint_dir")
    return done
