"""The MindSpore export: shard tuples from placements, the context, the cell map, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.mindspore._shards import op_shards, operand_tuple
from polyparallel.ir import Access, E
from polyparallel.transforms import canonicalize, fuse_elementwise

ROOT = Path(__file__).resolve().parents[1]


def _graph(model: torch.nn.Module, x: torch.Tensor):
    return fuse_elementwise(canonicalize(pp.capture(model, (x,))))


def _brute_blocks(expr, extents, split_dim, k, dim_extent):
    """Which tensor indices each of the k blocks of ``split_dim`` touches, enumerated."""
    import itertools

    names = list(extents)
    touched = [set() for _ in range(k)]
    size = extents[split_dim] // k
    for pt in itertools.product(*(range(extents[n]) for n in names)):
        env = dict(zip(names, pt))
        touched[env[split_dim] // size].add(expr.eval(env))
    return touched


def test_operand_tuple_matches_enumeration():
    # 64*h + d: h is the outer term, 2 blocks of h are 2 contiguous halves of the tensor dim
    ext = {"h": 4, "d": 8}
    expr = E("h") * 8 + E("d")
    t, why = operand_tuple(Access("in0", (expr,)), {"h": 2}, ext)
    blocks = _brute_blocks(expr, ext, "h", 2, 32)
    assert t == (2,) and not why
    assert all(b == set(range(i * 16, (i + 1) * 16)) for i, b in enumerate(blocks))
    # the inner term split interleaves: no MindSpore tuple
    t, why = operand_tuple(Access("in0", (expr,)), {"d": 2}, ext)
    blocks = _brute_blocks(expr, ext, "d", 2, 32)
    assert t is None and "inner term" in why
    assert blocks[0] != set(range(16))


def test_linear_shards_are_megatron_tuples():
    g = _graph(torch.nn.Sequential(torch.nn.Linear(16, 32)), torch.randn(8, 4, 16))
    op = next(o for o in g.ops if o.target == "aten.linear.default")
    prims, notes = op_shards(g, op, {"b": 4, "n": 2})  # column parallel: weight rows split
    assert not notes
    assert [(p.primitive, p.in_strategy) for p in prims] == [("MatMul", ((4, 1), (2, 1))),
                                                             ("BiasAdd", ((4, 2), (2,)))]
    prims, _ = op_shards(g, op, {"b": 4, "k": 2})  # row parallel: the reduction dim split on both
    assert prims[0].in_strategy == ((4, 2), (1, 2))
    # splitting the sequence (inner leading dim) under nn.Dense's flattening: no contiguous blocks
    prims, notes = op_shards(g, op, {"s": 2})
    assert not prims and "merges the leading dims" in notes[0]


def test_layernorm_last_dim_split_is_reported():
    g = _graph(torch.nn.Sequential(torch.nn.LayerNorm(16)), torch.randn(8, 16))
    op = next(o for o in g.ops if o.kind == "norm")
    norm_dim = [d.name for d in op.nest.dims][-1]
    prims, notes = op_shards(g, op, {norm_dim: 2})
    assert prims[0].in_strategy[0][-1] == 1 and any("last dim inside one device" in n for n in notes)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyparallel", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.slow
def test_bad_input_is_one_line_exit_2(tmp_path):
    r = _cli("export", str(tmp_path / "none.json"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot read" in r.stderr
    s = pp.Strategy(model=pp.strategy.ModelInfo(name="m", fingerprint="0" * 24),
                    mesh=pp.strategy.Mesh(axes=[pp.strategy.MeshAxis(name="dp", size=2)], devices=[0, 1]), dp=2,
                    stages=[pp.strategy.Stage(index=0, ops=["a", "b"], devices=[0, 1])])
    path = tmp_path / "s.json"
    s.to_json(path)
    r = _cli("export", str(path), "--to", "jax", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "export targets are mindspore" in r.stderr
    r = _cli("export", str(path), "--out", str(tmp_path / "o"), "--mindspore-model", "x:y", "--no-validate")
    assert r.returncode == 2 and "needs --model" in r.stderr
    # without a model: the context alone, the shards reported as not derived
    r = _cli("export", str(path), "--out", str(tmp_path / "o"), "--no-validate")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "o" / "mindspore_parallel.json").read_text())
    assert cfg["context"]["parallel_mode"] == "data_parallel" and cfg["context"]["device_num"] == 2
    assert any("no model was given" in u["why"] for u in cfg["unexpressed"])


@pytest.mark.slow
def test_user_cell_map_and_mindspore_check(tmp_path):
    pytest.importorskip("mindspore")
    strat = tmp_path / "s.json"
    r = _cli("search", "tests.mindspore_models:torch_mlp", "-c", "local-cpu:2", "--tp", "2", "--placements", "rule",
             "-o", str(strat))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "ms"
    r = _cli("export", str(strat), "--out", str(out), "--model", "tests.mindspore_models:torch_mlp",
             "--mindspore-model", "tests.mindspore_models:mindspore_mlp")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "mindspore_parallel.json").read_text())
    assert [(m["torch_module"], m["cell"], m["layer"]) for m in cfg["cell_map"]] == [
        ("0", "inp", "Dense"), ("1", "ln", "LayerNorm"), ("3", "head", "Dense")]
    v = cfg["validation"]
    assert v["context"].startswith("accepted") and "stand-alone graph mode" in v["cell"]
    assert "Invalid communication backend: CPU" in v["parallel_compile"]  # MindSpore 2.10's CPU refusal
    r = _cli("export", str(strat), "--out", str(tmp_path / "bad"), "--model", "tests.mindspore_models:torch_mlp",
             "--mindspore-model", "tests.mindspore_models:mindspore_wrong", "--no-validate")
    assert r.returncode == 2 and "inp.weight" in r.stderr


@pytest.mark.slow
def test_gpt_pipeline_export_puts_each_block_in_its_stage(tmp_path):
    """gpt-tiny, dp=4 x pp=2 on 8 devices: each block's cell gets the stage whose layers list it, the
    attention's primitives of the user Cell are found by its module, and MindSpore compiles the Cell."""
    pytest.importorskip("mindspore")
    strat = tmp_path / "s.json"
    r = _cli("search", "gpt-tiny", "-c", "local-cpu:8", "--pp", "2", "--dp", "4", "--sp", "1", "-o", str(strat))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "ms"
    r = subprocess.run([sys.executable, "-m", "polyparallel", "export", str(strat), "--out", str(out), "--model",
                        "gpt-tiny", "--mindspore-model", "models.mindspore_gpt:gpt_tiny"], capture_output=True,
                       text=True, cwd=ROOT / "examples", timeout=300)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "mindspore_parallel.json").read_text())
    s = json.loads(strat.read_text())
    want = {f"h.{layer}": st["index"] for st in s["stages"] for layer in st["layers"]}
    got = {c["cell"]: c["pipeline_stage"] for c in cfg["pipeline"] if c["cell"].startswith("h.")}
    assert got == want and len(want) == 2
    assert cfg["context"]["pipeline_stages"] == 2 and cfg["micro_batches"]["micro_size"] == s["microbatches"]
    attention = [m for m in cfg["cell_map"] if m["layer"] == "Block"]
    assert len(attention) == 2 and attention[0]["shards"] == [["scores", 0], ["softmax", 1], ["weighted", 2]]
    assert "6 of its cells given their pipeline stage" in cfg["validation"]["cell"]
    r = _cli("export", str(strat), "--out", str(tmp_path / "other"), "--model", "gpt-tiny", "--layers", "3")
    assert r.returncode == 2 and "not the one the strategy was searched for" in r.stderr  # another model


def test_api_context_of_a_pipeline_plan(tmp_path):
    from polyparallel.strategy import Mesh, MeshAxis, ModelInfo, Stage, Strategy

    s = Strategy(model=ModelInfo(name="m", fingerprint="0" * 24), dp=2, pp=2, microbatches=4, zero_stage=2, sp=1,
                 schedule="interleaved:2", global_batch=16,
                 mesh=Mesh(axes=[MeshAxis(name="pp", size=2), MeshAxis(name="dp", size=2)], devices=[0, 1, 2, 3]),
                 stages=[Stage(index=0, ops=["a", "b", "e", "f"], devices=[0, 1]),
                         Stage(index=1, ops=["c", "d", "g", "h"], devices=[2, 3])])
    r = pp.export(s, to="mindspore", out=tmp_path / "o", validate=False)
    ctx = r.config["context"]
    assert (ctx["parallel_mode"], ctx["device_num"], ctx["pipeline_stages"]) == ("semi_auto_parallel", 4, 2)
    assert ctx["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}
    assert ctx["parallel_optimizer_config"] == {"optimizer_level": "level2"} and ctx["enable_parallel_optimizer"]
    assert r.config["micro_batches"] == {"cell": "nn.PipelineCell", "micro_size": 4}
    assert (tmp_path / "o" / "report.md").read_text().startswith("# MindSpore parallel configuration of m")
    # a schedule MindSpore has no scheduler for is exported as its interleaved 1F1B, and the report says so
    bfs = pp.export(s.model_copy(update={"schedule": "looped_bfs:2"}), to="mindspore", out=tmp_path / "bfs",
                    validate=False)
    assert bfs.config["context"]["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}
    assert "**schedule=looped_bfs:2**: MindSpore has no looped_bfs pipeline scheduler" in \
        (tmp_path / "bfs" / "report.md").read_text()
    collab = s.model_copy(update={"mode": "collaborative"})
    with pytest.raises(ValueError, match="collaborative: export a center's synchronous plan"):
        pp.export(collab.model_copy(update={"collaborative": pp.strategy.Collaborative(
            centers=[pp.strategy.CenterPlan(name="a", devices=[0], share=1.0)], local_steps=1)}), out=tmp_path / "c",
            validate=False)


def test_context_parallelism_is_reported_as_not_expressed(tmp_path):
    """MindSpore's auto-parallel has no ring attention: a cp plan's devices are counted, and the
    report says that nothing splits the sequence between them."""
    from polyparallel.strategy import Mesh, MeshAxis, ModelInfo, Stage, Strategy

    s = Strategy(model=ModelInfo(name="m", fingerprint="0" * 24), cp=2, global_batch=4,
                 mesh=Mesh(axes=[MeshAxis(name="dp", size=1), MeshAxis(name="cp", size=2)], devices=[0, 1]),
                 stages=[Stage(index=0, ops=["a", "b"], devices=[0, 1])])
    r = pp.export(s, to="mindspore", out=tmp_path / "o", validate=False)
    assert r.config["context"]["device_num"] == 2
    assert "**cp=2**: context parallelism (ring attention" in (tmp_path / "o" / "report.md").read_text()
