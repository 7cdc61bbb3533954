"""The collaborative job's configuration records (pydantic, ``_records``) write the JSON they wrote before.

A job travels to Flower's apps, to a data-parallel center's workers and into the server's checkpoint as
JSON; :data:`BEFORE` holds the strings the hand-written ``to_json`` (asdict, nested by hand) wrote for
the configs of :func:`_configs` before the records moved to pydantic (commit 3618e18): four jobs that
together have every optional part: pruning (with distillation), overlapped and buffered rounds,
slowdowns, links, a per-layer bound, center plans (with per-op placements), fusion options and a user
model's builders. Ints stay ints (``"lr": 1``), an infinite timeout stays ``Infinity``.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec
from polyparallel.backends.collab._pruning import PruneError, PruneSpec
from tests.test_collab_cli import _run

BEFORE = {
    "prune": (
        '{"batch_size": 32, "centers": [{"data": "pkg.mod:rows", "devices": 1, "down_Bps": 1000000.0, '
        '"framework": "torch", "latency_s": 0.02, "name": "a", "plan": [["dp", 1]], "samples": 100, '
        '"slowdown": 2.5, "up_Bps": 500000.0}, {"data": "", "devices": 1, "down_Bps": 0.0, '
        '"framework": "torch", "latency_s": 0.0, "name": "b-2", "plan": [], "samples": 7, "up_Bps": 0.0}], '
        '"compression": "none", "fusion": "trimmed_mean", "fusion_options": [["beta", 0.1]], "holdout": 0.0, '
        '"layer_bound": 3.0, "local_steps": 3, "logit_adjust": 0.0, "lr": 1, "lr_schedule": "constant", '
        '"max_abs_update": 10000.0, "min_centers": 0, "min_cosine": -1.0, "model": {"hidden": 8, '
        '"in_shape": [1, 28, 28], "kind": "cnn", "loss": "auto", "mindspore": "", "norm": "group", '
        '"num_classes": 10, "vocab": 0}, "momentum": 0.0, "norm_bound": 4.0, '
        '"prune": {"allocation": "uniform", "distill": 0.5, "distill_teacher": "round", '
        '"distill_temperature": 2, "ema": 0.3, "ratio": 0.5, "rounds": 3, "score": "taylor", '
        '"score_batches": 2, "target": "channels", "warmup": 1}, "round_timeout_s": 120, "rounds": 4, '
        '"seed": 0, "step_bound": 10.0}'),
    "overlap": (
        '{"batch_size": 32, "centers": [{"data": "", "devices": 1, "down_Bps": 0.0, "framework": "torch", '
        '"latency_s": 0.0, "name": "x", "plan": [], "samples": 0, "slowdown": 3, "up_Bps": 0.0}, '
        '{"data": "", "devices": 1, "down_Bps": 0.0, "framework": "torch", "latency_s": 1, "name": "y_1", '
        '"plan": [], "samples": 0, "up_Bps": 0.0}], "compression": "int8", "fusion": "centered_clip", '
        '"fusion_options": [["iters", 3], ["tau", 1]], "holdout": 0.1, "layer_bound": 2.5, "local_steps": 5, '
        '"logit_adjust": 0.5, "lr": 0.05, "lr_schedule": "cosine", "max_abs_update": 100.0, '
        '"min_centers": 0, "min_cosine": 0.2, "model": {"hidden": 12, "in_shape": [16], "kind": "mlp", '
        '"loss": "auto", "mindspore": "", "norm": "batch", "num_classes": 4, "vocab": 0}, "momentum": 0.9, '
        '"norm_bound": 0, "overlap": 2, "round_timeout_s": 600.0, "rounds": 3, "seed": 7, "step_bound": 5}'),
    "buffered": (
        '{"batch_size": 32, "buffer": 2, "centers": [{"data": "", "devices": 2, "down_Bps": 0.0, '
        '"framework": "torch", "latency_s": 0.0, "name": "t", "plan": [["op_placements", [[["fc1", "fc2"], '
        '"col", ["fc1"]]]], ["tp", 2]], "samples": 0, "up_Bps": 0.0}, {"data": "", "devices": 1, '
        '"down_Bps": 0.0, "framework": "mindspore", "latency_s": 0.0, "name": "m", "plan": [], "samples": 0, '
        '"up_Bps": 0.0}, {"data": "", "devices": 1, "down_Bps": 0.0, "framework": "paddle", '
        '"latency_s": 0.0, "name": "p", "plan": [], "samples": 0, "slowdown": 1.5, "up_Bps": 0.0}], '
        '"compression": "fp16", "fusion": "median", "fusion_options": [], "holdout": 0.0, "local_steps": 10, '
        '"logit_adjust": 0.0, "lr": 0.05, "lr_schedule": "constant", "max_abs_update": 10000.0, '
        '"max_staleness": 3, "min_centers": 2, "min_cosine": -1.0, "model": {"builders": [["paddle", '
        '"mypkg.pd:net"]], "hidden": 32, "in_shape": [], "kind": "mypkg.models:net", "loss": "mse", '
        '"mindspore": "mypkg.ms:net", "norm": "batch", "num_classes": 0, "vocab": 0}, "momentum": 0.0, '
        '"norm_bound": 4.0, "round_timeout_s": Infinity, "rounds": 3, "seed": 0, "step_bound": 10.0}'),
    "plain": (
        '{"batch_size": 32, "centers": [{"data": "", "devices": 1, "down_Bps": 0.0, "framework": "torch", '
        '"latency_s": 0.0, "name": "a", "plan": [], "samples": 0, "up_Bps": 0.0}], "compression": "none", '
        '"fusion": "centered_clip", "fusion_options": [], "holdout": 0.0, "local_steps": 10, '
        '"logit_adjust": 0.0, "lr": 0.05, "lr_schedule": "constant", "max_abs_update": 10000.0, '
        '"min_centers": 0, "min_cosine": -1.0, "model": {"hidden": 32, "in_shape": [4], "kind": "mlp", '
        '"loss": "auto", "mindspore": "", "norm": "batch", "num_classes": 3, "vocab": 0}, "momentum": 0.0, '
        '"norm_bound": 4.0, "round_timeout_s": 600.0, "rounds": 3, "seed": 0, "step_bound": 10.0}'),
}
MODELS = {
    "model_user": (
        '{"kind": "mypkg.models:net", "in_shape": [], "num_classes": 0, "hidden": 32, "vocab": 0, '
        '"norm": "batch", "loss": "mse", "mindspore": "mypkg.ms:net", "builders": [["paddle", '
        '"mypkg.pd:net"]]}'),
    "model_cnn": (
        '{"kind": "cnn", "in_shape": [1, 28, 28], "num_classes": 10, "hidden": 8, "vocab": 0, '
        '"norm": "group", "loss": "auto", "mindspore": ""}'),
}


def _configs() -> dict[str, CollabConfig]:
    prune = CollabConfig(
        centers=(CenterSpec("a", data="pkg.mod:rows", samples=100, down_Bps=1e6, up_Bps=5e5, latency_s=0.02,
                            slowdown=2.5, plan={"dp": 1}),
                 CenterSpec("b-2", samples=7)),
        model=ModelSpec("cnn", (1, 28, 28), 10, hidden=8, norm="group"),
        fusion="trimmed_mean", fusion_options={"beta": 0.1}, rounds=4, local_steps=3, lr=1, round_timeout_s=120,
        layer_bound=3.0, prune=PruneSpec(0.5, rounds=3, score="taylor", score_batches=2, ema=0.3, target="channels",
                                         allocation="uniform", warmup=1, distill=0.5,
                                         distill_temperature=2, distill_teacher="round"))
    overlap = CollabConfig(
        centers=(CenterSpec("x", slowdown=3), CenterSpec("y_1", latency_s=1)),
        model=ModelSpec("mlp", (16,), 4, hidden=12), fusion="centered_clip",
        fusion_options={"tau": 1, "iters": 3}, local_steps=5, overlap=2, layer_bound=2.5, logit_adjust=0.5,
        lr_schedule="cosine", holdout=0.1, min_cosine=0.2, compression="int8", momentum=0.9, seed=7,
        max_abs_update=100.0, norm_bound=0, step_bound=5)
    buffered = CollabConfig(
        centers=(CenterSpec("t", devices=2, plan={"tp": 2, "op_placements": [[["fc1", "fc2"], "col", ["fc1"]]]}),
                 CenterSpec("m", framework="mindspore"), CenterSpec("p", framework="paddle", slowdown=1.5)),
        model=ModelSpec("mypkg.models:net", loss="mse", mindspore="mypkg.ms:net",
                        builders={"paddle": "mypkg.pd:net"}),
        fusion="median", buffer=2, max_staleness=3, min_centers=2, compression="fp16", round_timeout_s=float("inf"))
    plain = CollabConfig(centers=(CenterSpec("a"),), model=ModelSpec("mlp", (4,), 3))
    return {"prune": prune, "overlap": overlap, "buffered": buffered, "plain": plain}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_a_job_writes_the_json_of_before_and_reads_it_back(name):
    cfg = _configs()[name]
    assert cfg.to_json() == BEFORE[name]
    back = CollabConfig.from_json(BEFORE[name])
    assert back == cfg and hash(back) == hash(cfg) and back.to_json() == BEFORE[name]
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # a job also travels pickled to spawned processes
    assert CollabConfig.from_json(dataclasses.replace(cfg, seed=9).to_json()).seed == 9


def test_the_model_spec_writes_its_json_of_before():
    cfgs = _configs()
    for name, spec in (("model_user", cfgs["buffered"].model), ("model_cnn", cfgs["prune"].model)):
        assert spec.to_json() == MODELS[name] and ModelSpec.from_json(MODELS[name]) == spec
    assert type(ModelSpec.from_json(MODELS["model_cnn"]).in_shape) is tuple


def test_records_take_dicts_and_lists_as_the_hand_written_code_did():
    cfg = CollabConfig(centers=[{"name": "a", "plan": {"dp": 1}}], model={"kind": "mlp", "in_shape": [4],
                       "num_classes": 3}, fusion="trimmed_mean", fusion_options={"beta": 0.1},
                       prune={"ratio": 0.5}, rounds=2)
    assert cfg.centers == (CenterSpec("a", plan=(("dp", 1),)),) and cfg.model == ModelSpec("mlp", (4,), 3)
    assert cfg.prune == PruneSpec(0.5) and cfg.fusion_options == (("beta", 0.1),)
    assert ModelSpec("mlp", [4.0], 3).in_shape == (4,)


def test_bad_values_and_bad_json_are_one_line():
    with pytest.raises(PruneError, match=r"warmup must be an integer in \[0, K=4\)"):  # the record's own check
        PruneSpec(0.5, rounds=4, warmup=1.5)
    with pytest.raises(ValueError, match=r"^center 'a': devices must be >= 1$"):  # also nested, from JSON
        CollabConfig.from_json(BEFORE["plain"].replace('"devices": 1', '"devices": 0'))
    with pytest.raises(TypeError, match=r"^CenterSpec: foo: unexpected keyword argument$"):
        CenterSpec("a", foo=1)
    cases = {
        BEFORE["plain"].replace('"devices": 1', '"devicez": 1'): "CollabConfig: centers.0.devicez: unknown field",
        BEFORE["plain"].replace('"lr": 0.05', '"lr": "x"'): "CollabConfig: lr: input should be a number (got 'x')",
        BEFORE["plain"].replace('"centers"', '"centres"'): "CollabConfig: centers: field required; centres: unknown",
        BEFORE["plain"][:40]: "CollabConfig: invalid JSON: EOF while parsing",
        "[]": "CollabConfig: input should be an object",
    }
    for text, msg in cases.items():
        with pytest.raises(ValueError) as e:
            CollabConfig.from_json(text)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"^CenterSpec: devices: input should be a valid integer.*\(got 'two'\)$"):
        CenterSpec("a", devices="two")


def test_the_cli_reports_a_bad_job_file_in_one_line(tmp_path, capsys):
    job = tmp_path / "job.json"
    job.write_text(BEFORE["plain"].replace('"devices": 1', '"devicez": 1'))
    for argv in (["collab", "--config", str(job), "--save-config", str(tmp_path / "out.json")],
                 ["serve", "--config", str(job)]):
        code, _, err = _run(argv, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"{job}: not a collab job file: CollabConfig: centers.0.devicez: unknown field" in err, err
