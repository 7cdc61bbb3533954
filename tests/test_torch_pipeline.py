"""Torch backend, pipeline parallelism: a Strategy with pp > 1 trains as single-process training does.

Each config launches 2 or 4 CPU worker processes (gloo) with torch.distributed.run and compares the
per-step loss with a plain single-process loop on the same seed and global batch (SGD, fp32). The
tiny GPT has its lm_head tied to the token embedding, which the pipeline puts on different stages,
so the tied-gradient all-reduce is exercised too.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.torch import Unsupported, plan_for, train
from polyparallel.backends.torch import _examples as ex
from polyparallel.strategy import Mesh
from tests.test_torch_backend import LR, SEED, STEPS, _max_rel, _single

pytestmark = pytest.mark.slow


@functools.cache
def _pipeline_strategy(n: int, **constraints) -> pp.Strategy:
    x, y = ex.gpt_data(0)
    return pp.search(ex.tiny_gpt(), (x,), f"local-cpu:{n}", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                     constraints={"pp": 2, "tp": 1, "recompute": "none", **constraints})


def _mutated_reference(microbatches: int, *, grad_scale: float = 1.0, untie: bool = False) -> list[float]:
    """Single-process training that is wrong in a way a pipeline could be: micro-batch gradients
    summed without the 1/M (``grad_scale=M``), or the tied embedding/head trained as two weights."""
    torch.manual_seed(SEED)
    m = ex.tiny_gpt()
    if untie:
        m.lm_head.weight = torch.nn.Parameter(m.wte.weight.detach().clone())
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        x, y = ex.gpt_data(step)
        opt.zero_grad()
        losses = [m(xm, ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
        (sum(losses) * (grad_scale / microbatches)).backward()
        opt.step()
        out.append(float(sum(losses)) / microbatches)
    return out


def test_stages_map_onto_the_model() -> None:
    """The cut follows the strategy's op ranges: embeddings and block 0 on stage 0, block 1, the
    final norm and the tied head on stage 1, the loss on the last stage's loss function."""
    s = _pipeline_strategy(2, dp=1, microbatches=4, schedule="gpipe")
    plan = plan_for(s, ex.tiny_gpt(), ex.gpt_data(0))
    pipe = plan.pipeline
    assert (plan.pp, pipe.stages, pipe.virtual, pipe.schedule, pipe.microbatches) == (2, 2, 1, "gpipe", 4)
    assert pipe.cuts == (s.stages[1].ops[0],)
    first, last = (set(p) for p in pipe.chunk_params)
    assert {"wpe.weight", "h.0.qkv.weight", "h.0.fc_out.bias"} <= first and not any(p.startswith("h.1.") for p in first)
    assert {"h.1.qkv.weight", "ln_f.weight"} <= last and not any(p.startswith("h.0.") for p in last)
    tied = dict(pipe.tied)
    assert len(tied) == 1 and next(iter(tied.values())) == (0, 1)  # wte.weight is lm_head.weight
    # every parameter of the model is held by some stage, and only the tied one by two
    names = {n for n, _ in ex.tiny_gpt().named_parameters()}
    held = first | last
    assert len(held) == len(names) and len(first & last) == 1


def test_chunks_chained_give_the_model_loss_and_gradients() -> None:
    """Cuts anywhere (mid-block too: a transposed q crosses the cut before attention) chain back to
    the unsplit model's loss and gradients; values sent between stages are contiguous (p2p needs it)."""
    from polyparallel.backends.torch._pipeline import split_model

    torch.manual_seed(SEED)
    model = ex.tiny_gpt()
    x, y = ex.gpt_data(0)
    loss = model(x[:2], y[:2])
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    split = split_model(model, x[:2], y[:2], ["embedding_1", "scaled_dot_product_attention", "linear_5"])
    assert len(split.chunks) == 4
    acts: tuple[torch.Tensor, ...] = (x[:2],)
    for c, chunk in enumerate(split.chunks):
        acts = chunk(*acts)
        assert all(a.is_contiguous() for a in acts), c
    got = split.tail(*acts, y[:2])
    got.backward()
    assert torch.equal(got, loss)
    # in one process the chunks share parameter objects, so the tied weight's gradient from the
    # first and the last chunk accumulates in one tensor, as the workers' all-reduce sums it
    grads = {n: p.grad for chunk in split.chunks for n, p in chunk.named_parameters()}
    assert len(grads) == len(want)  # every parameter once; the tied one by its lm_head name
    for n, g in grads.items():
        torch.testing.assert_close(g, want.get(n, want["wte.weight"]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(90)
def test_pp2_gpipe_matches_single_process(tmp_path: Path) -> None:
    s = _pipeline_strategy(2, dp=1, microbatches=4, schedule="gpipe")
    assert (s.pp, s.dp, s.microbatches, s.schedule) == (2, 1, 4, "gpipe")
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED, log_dir=tmp_path)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"PP=2 GPipe m=4: max relative loss difference {err:.2e}")
    assert err <= 1e-4
    assert (tmp_path / "train.jsonl").read_text().count("\n") == STEPS
    assert all(r["step_time_s"] > 0 for r in log)
    # the comparison can fail: a pipeline that forgot the 1/M micro-batch scaling, or that trained
    # the tied embedding and head as two weights, would be far off
    wrong_scale = _max_rel(log, _mutated_reference(4, grad_scale=4.0))
    untied = _max_rel(log, _mutated_reference(4, untie=True))
    print(f"same log vs unscaled micro-batches {wrong_scale:.2e}, vs untied weights {untied:.2e}")
    assert wrong_scale > 1e-2 and untied > 1e-3


@pytest.mark.timeout(90)
def test_pp2_1f1b_matches_single_process() -> None:
    s = _pipeline_strategy(2, dp=1, microbatches=4, schedule="1f1b")
    assert (s.pp, s.microbatches, s.schedule) == (2, 4, "1f1b")
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED, profile_comm=True)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"PP=2 1F1B m=4: max relative loss difference {err:.2e}; collectives {log[0]['comm_ops']}")
    assert err <= 1e-4
    # rank 0 (stage 0) sends activations and receives gradients of 4 micro-batches (p2p), all-reduces
    # the tied embedding's gradient with the last stage and, once over all ranks, the micro-batch
    # losses and target counts that scale the gradients; torch's profiler records them (the p2p
    # events it closes within the step: 7 of 8 each way here)
    assert all(r["comm_s"] > 0 and r["comm_ops"].get("gloo:all_reduce") == 2 and r["comm_ops"].get("gloo:send", 0) >= 4
               and r["comm_ops"].get("gloo:recv", 0) >= 4 for r in log)


@pytest.mark.timeout(150)
def test_pp2_interleaved_matches_single_process_and_resumes(tmp_path: Path) -> None:
    """Interleaved 1F1B, 2 chunks per stage (chunk k on stage k mod 2), checkpointed and resumed."""
    s = _pipeline_strategy(2, dp=1, microbatches=4, schedule="interleaved")
    assert (s.pp, s.microbatches, s.schedule) == (2, 4, "interleaved:2")
    assert [len(st.ops) for st in s.stages] == [4, 4]
    first = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS - 1, lr=LR, seed=SEED, checkpoint_dir=tmp_path)
    assert (tmp_path / "LATEST").read_text() == str(STEPS - 2)
    # resumed from the checkpoint with another seed: the weights must come from the checkpoint
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED + 1, checkpoint_dir=tmp_path)
    assert log[: STEPS - 1] == first
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"PP=2 interleaved x2 m=4 (checkpointed, resumed for the last step): max relative loss difference {err:.2e}")
    assert err <= 1e-4


@pytest.mark.timeout(120)
def test_pp2_looped_bfs_matches_single_process() -> None:
    """Breadth-first, 2 chunks per stage: every micro-batch through chunk 0 of both stages, then chunk 1,
    then the backwards in reverse (the schedule added through the plan record's schedule table)."""
    s = _pipeline_strategy(2, dp=1, microbatches=4, schedule="looped_bfs")
    assert (s.pp, s.microbatches, s.schedule) == (2, 4, "looped_bfs:2")
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"PP=2 looped BFS x2 m=4: max relative loss difference {err:.2e}")
    assert err <= 1e-4


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("zero_stage", "schedule"), [(3, "1f1b"), (0, "gpipe")])
def test_dp2_x_pp2_matches_single_process(zero_stage: int, schedule: str) -> None:
    """2-D: FSDP2 (ZeRO-3) or replicated parameters with all-reduced gradients (ZeRO-0) over dp=2
    inside each of 2 pipeline stages, 4 processes on a (pp, dp) mesh."""
    s = _pipeline_strategy(4, dp=2, microbatches=2, schedule=schedule, zero_stage=zero_stage)
    assert (s.pp, s.dp, s.zero_stage, s.schedule) == (2, 2, zero_stage, schedule)
    assert [a.name for a in s.mesh.axes if a.size > 1] == ["pp", "dp"]
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"DP2 x PP2 (ZeRO-{zero_stage}, {schedule}, m=2): max relative loss difference {err:.2e}")
    assert err <= 1e-4


def test_refuses_stages_it_cannot_cut() -> None:
    s = _pipeline_strategy(2, dp=1, microbatches=2, schedule="1f1b")
    model, batch = ex.tiny_gpt(), ex.gpt_data(0)

    def with_stage1(ops: list[str], **extra) -> pp.Strategy:
        st = s.stages[1].model_copy(update={"ops": ops, **extra})
        return s.model_copy(update={"stages": [s.stages[0], st]})

    # a boundary at an op this model does not have (a strategy for another model)
    with pytest.raises(Unsupported, match=r"starts at op 'conv2d_9'.*cannot be mapped onto this model"):
        plan_for(with_stage1(["conv2d_9", "cross_entropy_loss"]), model, batch)
    # a boundary between qkv's split and its getitem: a list, not a tensor, would cross stages
    with pytest.raises(Unsupported, match=r"value 'split' \(list\).*only tensors can cross"):
        plan_for(with_stage1(["getitem", "cross_entropy_loss"], layers=[0, 1]), model, batch)
    # layers that disagree with where the ops sit in this model
    with pytest.raises(Unsupported, match=r"stage 1 .* holds layers \[1\] .* lists \[0\]"):
        plan_for(with_stage1(s.stages[1].ops, layers=[0]), model, batch)
    # a last stage that only reshapes the logits for the loss: no parameters to optimise
    st0 = s.stages[0].model_copy(update={"layers": [0, 1]})
    st1 = s.stages[1].model_copy(update={"ops": ["flatten", "cross_entropy_loss"], "layers": []})
    with pytest.raises(Unsupported, match=r"stage 1 holds no parameters"):
        plan_for(s.model_copy(update={"stages": [st0, st1]}), model, batch)
    with pytest.raises(Unsupported, match=r"schedule 'zero-bubble'"):
        plan_for(s.model_copy(update={"schedule": "zero-bubble"}), model, batch)
    with pytest.raises(Unsupported, match=r"not divisible by dp\*microbatches=3"):
        plan_for(s.model_copy(update={"microbatches": 3}), model, batch)
    # sequence and tensor parallelism inside the stages run (tests/test_torch_sp_pipeline.py), with FSDP2
    with pytest.raises(Unsupported, match=r"dp·sp=2 with tp=2 and zero_stage=0: DDP over DTensor parameters"):
        plan_for(s.model_copy(update={"sp": 2, "tp": 2}), model, batch)


def test_rank_layout_follows_the_mesh() -> None:
    """Stage-major as the planner writes meshes, or dp-major when a hand-written mesh lists dp first;
    stage device lists that contradict the mesh are refused."""
    s = _pipeline_strategy(4, dp=2, microbatches=2, schedule="1f1b", zero_stage=0)
    model, batch = ex.tiny_gpt(), ex.gpt_data(0)
    assert plan_for(s, model, batch).pipeline.pp_major
    assert [st.devices for st in s.stages] == [[0, 1], [2, 3]]
    flipped = Mesh(axes=list(reversed(s.mesh.axes)), devices=s.mesh.devices)
    with pytest.raises(Unsupported, match=r"stage 0 lists devices \[0, 1\] but the mesh \['dp', 'pp'\] puts it on "
                                          r"\[0, 2\]"):
        plan_for(s.model_copy(update={"mesh": flipped}), model, batch)
    stages = [st.model_copy(update={"devices": [st.index, st.index + 2]}) for st in s.stages]
    assert not plan_for(s.model_copy(update={"mesh": flipped, "stages": stages}), model, batch).pipeline.pp_major


def test_exported_stages_run_with_bf16_parameters() -> None:
    """FSDP2 with bf16 parameters (and autocast) feeds the stages bf16 where the fp32 capture had
    fp32: export's dtype checks of a cast's input (HF LLaMA's RMSNorm upcast) must not be in the
    stages — the search writes LLaMA bf16 dp2 x pp2 ZeRO-3 plans, which crashed in train."""
    from polyparallel.backends.torch._pipeline import _export
    from tests.zoo import _lm_data, hf_llama

    x, y = _lm_data(0)
    torch.manual_seed(0)
    m = hf_llama()
    want = m(x, y)
    gm = _export(m, x, y)
    for p in gm.parameters():  # as FSDP2's MixedPrecisionPolicy hands them to the stage; buffers stay fp32
        p.data = p.data.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gm(x, y)
    assert torch.isfinite(got) and abs(got.item() - want.item()) < 0.05 * abs(want.item())
