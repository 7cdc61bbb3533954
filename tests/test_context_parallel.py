"""Context parallelism (ring attention with causal load balancing): the sharding covers every
causal query-key pair exactly once, ring attention equals SDPA on the whole sequence (float64, to
rounding), LLaMA trains under cp / cp×dp / cp×tp with the losses of one process, and the planner
prices cp and chooses it for long sequences (and says why)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import polyparallel as pp
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch import train
from polyparallel.backends.torch._context_parallel import _pairs, context_shard, ring_attention, shard_positions
from polyparallel.backends.torch._procs import free_port
from polyparallel.backends.torch.capabilities import plan_problems
from polyparallel.cli import main
from polyparallel.cost_models.comm import collective_time
from polyparallel.plan import Plan
from polyparallel.planning.constraints import Constraints


def test_shards_cover_the_sequence_and_every_causal_pair_once() -> None:
    """Brute force: over the ranks' positions and the ring's steps, each pair (query i, key j <= i)
    is computed exactly once and no other; every shard computes the same number of pairs."""
    for cp in (1, 2, 3, 4):
        S = 4 * cp * 3
        pos = [shard_positions(S, cp, r).tolist() for r in range(cp)]
        assert sorted(p for ps in pos for p in ps) == list(range(S))
        c = S // (2 * cp)
        for causal in (True, False):
            seen: dict[tuple[int, int], int] = {}
            work = []
            for r in range(cp):
                n = 0
                for i in range(cp):
                    src = (r - i) % cp
                    for a, b, diag in _pairs(r, src, cp, causal):
                        for qi in range(c):
                            for kj in range(c):
                                if diag and kj > qi:
                                    continue
                                key = (pos[r][a * c + qi], pos[src][b * c + kj])
                                seen[key] = seen.get(key, 0) + 1
                                n += 1
                work.append(n)
            want = {(i, j) for i in range(S) for j in range(S) if j <= i or not causal}
            assert set(seen) == want and set(seen.values()) == {1}
            assert len(set(work)) == 1  # load balanced


def test_shard_positions_refuse_a_sequence_that_does_not_cut_into_2cp_chunks() -> None:
    with pytest.raises(ValueError, match=r"cp=3 cuts the sequence into 6 equal chunks; .* 16 is not divisible"):
        shard_positions(16, 3, 0)
    t = torch.arange(24).reshape(2, 12)
    assert context_shard(t, 3, 1, dim=1)[0].tolist() == [2, 3, 8, 9]


def test_the_plan_record_takes_ulysses_or_ring_not_both() -> None:
    assert Plan(cp=2, dp=2).world == 4 and Plan(cp=4).seq == 4
    assert any("choose Ulysses (sp) or ring attention (cp)" in p for p in Plan(sp=2, cp=2).problems())
    with pytest.raises(ValueError, match="pin Ulysses"):
        Constraints(sp=2, cp=2)


def test_a_ring_shift_is_priced_by_its_slowest_hop() -> None:
    """Inside one node every hop is NVLink; a ring over two nodes has two hops on the slower
    inter-node links, which set the pace (priced as the same bytes sent point to point there)."""
    cl = pp.Cluster.resolve("dgx-a100x8")
    n = 64e6
    inside = collective_time(cl, "shift", n, list(range(4))).seconds
    across = collective_time(cl, "shift", n, [0, 1, 8, 9]).seconds
    assert inside == pytest.approx(collective_time(cl, "p2p", n, [0, 1]).seconds, rel=1e-9)
    assert across == pytest.approx(collective_time(cl, "p2p", n, [1, 8]).seconds, rel=1e-9)
    assert across > 2 * inside


def _llama(seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    cfg = pp.models.LlamaConfig(vocab=256, seq=seq, layers=2, hidden=256, heads=8, kv_heads=8, ffn=512)
    ids = torch.randint(0, 256, (1, seq))
    return pp.models.Llama(cfg), (ids, ids)


def test_the_cost_model_prices_ring_attention_and_hides_it_behind_the_attention() -> None:
    """cp's K/V transfers are 2cp-1 shifts per attention and micro-batch in the backward, cp-1 in
    the forward; at a long sequence the attention's compute hides them (exposed < priced), and
    cp=2 costs less sequence communication than Ulysses sp=2's all-to-alls of q, k, v, o."""
    model, batch = _llama(4096)
    ring = pp.evaluate(model, batch, "dgx-a100x8", cp=2, dp=1, batch_size=1, recompute="none")
    uly = pp.evaluate(model, batch, "dgx-a100x8", sp=2, dp=1, batch_size=1, recompute="none")
    assert ring.cp == 2 and ring.sp == 1 and uly.sp == 2
    assert [a.name for a in ring.mesh.axes] == ["dp", "cp"]
    assert ring.estimate.breakdown["sequence_parallel"] < uly.estimate.breakdown["sequence_parallel"]
    # the same per-rank work and memory as Ulysses (both hold 1/2 of every activation)
    assert ring.estimate.breakdown["compute"] == pytest.approx(uly.estimate.breakdown["compute"], rel=0.05)
    assert ring.estimate.memory_bytes_max == pytest.approx(uly.estimate.memory_bytes_max, rel=0.05)


def test_cp_is_refused_on_a_model_without_attention() -> None:
    with pytest.raises(ValueError, match="context parallelism splits a token sequence around attention"):
        pp.evaluate(ex.tiny_mlp(), torch.randn(8, 32), "local-cpu:2", cp=2, dp=1)


def test_the_cli_pins_cp_and_refuses_it_with_sp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["search", "gpt-tiny", "--cluster", "local-cpu:2", "--sp", "2", "--cp", "2"])
    assert e.value.code == 2
    assert "pin Ulysses (sp) or ring attention (cp)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# with processes (slow tier)


def _ring_worker(rank: int, cp: int, port: int, causal: bool, gqa: bool, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        g = torch.Generator().manual_seed(0)
        B, H, S, D = 2, 4, 8 * cp, 8
        hk = 2 if gqa else H
        q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (H, hk, hk))
        grad = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=gqa)
        ref.backward(grad)
        mine = [context_shard(t, cp, rank, 2).requires_grad_() for t in (q, k, v)]
        o = ring_attention(*mine, dist.group.WORLD, is_causal=causal, enable_gqa=gqa)
        o.backward(context_shard(grad, cp, rank, 2))
        errs = [(o - context_shard(ref, cp, rank, 2)).abs().max().item()]
        errs += [(m.grad - context_shard(w.grad, cp, rank, 2)).abs().max().item() for m, w in zip(mine, whole)]
        out.put(max(errs))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_sdpa_on_the_whole_sequence(cp: int) -> None:
    """Output and the gradients of q, k, v, causal and not, with grouped K/V heads: float64
    rounding (1e-15), so the algorithm is exact (the fp32 runs below differ by rounding only)."""
    ctx = mp.get_context("spawn")
    for causal in (True, False):
        for gqa in (False, True):
            q = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_ring_worker, args=(r, cp, port, causal, gqa, q)) for r in range(cp)]
            for p in procs:
                p.start()
            try:
                errs = [q.get(timeout=180) for _ in procs]
            finally:
                for p in procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
            assert max(errs) < 1e-12, (causal, gqa, errs)


def _llama_strategy(devices: int, **degrees: int) -> pp.Strategy:
    from tests.test_torch_tp import tiny_llama

    x, y = ex.gpt_data(0)
    return pp.evaluate(tiny_llama(), (x, y), f"local-cpu:{devices}", batch_size=ex.BATCH, recompute="none",
                       microbatches=1, **degrees)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("degrees", [dict(cp=2), dict(cp=4), dict(cp=2, dp=2, zero_stage=1),
                                     dict(cp=2, tp=2, zero_stage=1)],
                         ids=["cp2", "cp4", "cp2xdp2-fsdp", "cp2xtp2"])
def test_llama_under_context_parallelism_matches_single_process(degrees: dict[str, int]) -> None:
    """The project's LLaMA (rotary tables, grouped K/V) with queries and keys sharp enough that
    the positions move the loss: each rank holds 2 of 2cp chunks of every sequence and the rotary
    rows of its positions; losses equal one process's to fp32 rounding."""
    from tests.test_torch_backend import LR, SEED, STEPS, _single
    from tests.test_torch_tp import sharp_llama

    devices = degrees.get("cp", 1) * degrees.get("dp", 1) * degrees.get("tp", 1)
    s = _llama_strategy(devices, **degrees)
    assert (s.cp, s.dp, s.tp) == (degrees["cp"], degrees.get("dp", 1), degrees.get("tp", 1))
    log = train(s, sharp_llama, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    assert log[0]["rank0_input_shape"] == [ex.BATCH // degrees.get("dp", 1), 16 // degrees["cp"]]
    ref = _single(sharp_llama, ex.gpt_data)
    err = max(abs(r["loss"] - want) / abs(want) for r, want in zip(log, ref, strict=True))
    print(f"{degrees} LLaMA: max relative loss difference {err:.2e}")
    assert err <= 1e-6


def test_cp_refusals_name_the_fix() -> None:
    """A sequence that does not cut into 2cp chunks is refused before launch with what to change;
    grouped K/V heads that Ulysses cannot split over tp*sp do not limit ring attention."""
    from polyparallel.backends.torch._tensor_parallel import capture_for_strategy
    from tests.test_torch_tp import tiny_llama

    x, y = ex.gpt_data(0)
    g = capture_for_strategy(tiny_llama, (x, y))
    assert plan_problems(g, Plan(cp=2)) == []
    why = plan_problems(g, Plan(cp=3))
    assert any("not divisible by 2·cp = 6" in w for w in why), why
    assert plan_problems(g, Plan(cp=2, pp=2, microbatches=2)) == []  # inside stages: the graph pass
    # 2 K/V heads: Ulysses cannot split them over tp*sp = 4, ring attention needs them over tp only
    assert plan_problems(g, Plan(cp=2, pp=2, tp=2, microbatches=2, zero_stage=1)) == []
    assert any("2 heads do not split over 4 ranks" in w
               for w in plan_problems(g, Plan(sp=2, pp=2, tp=2, microbatches=2, zero_stage=1)))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_hf_models_under_cp_and_sp_run_as_the_rewritten_graph_and_match_single_process(name: str) -> None:
    """HF LLaMA / Qwen2 build a causal mask and rotary positions from aranges: the eager run cannot
    shard them, so without pipeline stages the model runs as its exported graph rewritten for the
    shards (one stage): ring attention (cp=2) and Ulysses (sp=2) both equal one process."""
    from tests import zoo
    from tests.test_torch_backend import LR, SEED, STEPS

    fn = getattr(zoo, name)
    x, y = zoo.lm_data(0)
    ref = ex.single_process_losses(fn, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    for degrees in (dict(cp=2), dict(sp=2)):
        s = pp.evaluate(fn(), (x[:4], y[:4]), "local-cpu:2", batch_size=zoo.BATCH, recompute="none",
                        microbatches=1, **degrees)
        assert (s.cp, s.sp, s.pp) == (degrees.get("cp", 1), degrees.get("sp", 1), 1) and not s.search.notes
        log = train(s, fn, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
        err = max(abs(r["loss"] - want) / abs(want) for r, want in zip(log, ref, strict=True))
        print(f"{name} {degrees}: max relative loss difference {err:.2e}")
        assert err <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_hf_models_cp2_x_tp2_run_as_the_rewritten_graph_and_match_single_process(name: str) -> None:
    """cp=2 × tp=2 (FSDP2) without pipeline stages: the one graph stage takes the tensor-parallel pass,
    then ring attention over each rank's h/tp heads (HF's 2 K/V heads: Ulysses would need 4)."""
    from tests import zoo
    from tests.test_torch_backend import LR, SEED, STEPS

    fn = getattr(zoo, name)
    x, y = zoo.lm_data(0)
    s = pp.evaluate(fn(), (x[:4], y[:4]), "local-cpu:4", batch_size=zoo.BATCH, recompute="none", microbatches=1,
                    cp=2, tp=2, zero_stage=1)
    assert (s.cp, s.tp, s.pp) == (2, 2, 1) and not s.search.notes
    log = train(s, fn, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    ref = ex.single_process_losses(fn, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    assert max(abs(r["loss"] - w) / abs(w) for r, w in zip(log, ref, strict=True)) <= 1e-6


def test_search_checks_a_graph_run_cp_plan_with_the_batch_train_gives() -> None:
    """A search that writes HF LLaMA's cp=2 (pp=1, run as its exported graph) checks it as train does,
    with one global batch: the check without one raised 'plan_for needs one global batch'."""
    from tests import zoo

    x, y = zoo.lm_data(0)
    s = pp.search(zoo.hf_llama(), (x, y), "local-cpu:2", batch_size=zoo.BATCH, constraints={"cp": 2})
    assert (s.cp, s.pp) == (2, 1) and not any(n.startswith("planning only") for n in s.search.notes)


def test_profile_memory_is_refused_before_launch_where_the_pipeline_schedule_runs_the_plan(tmp_path: Path) -> None:
    """HF LLaMA's cp=2 runs as its exported graph rewritten for the shards, under the pipeline
    schedule (pp=1): torch's MemTracker cannot count its backward, so it is refused before launch."""
    from tests import zoo

    x, y = zoo.lm_data(0)
    s = pp.evaluate(zoo.hf_llama(), (x[:4], y[:4]), "local-cpu:2", batch_size=zoo.BATCH, recompute="none",
                    microbatches=1, cp=2)
    with pytest.raises(ValueError, match="MemTracker"):
        train(s, zoo.hf_llama, zoo.lm_data, steps=1, profile_memory=True, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_inside_pipeline_stages_matches_single_process() -> None:
    """cp=2 × pp=2 (GPipe): the project's LLaMA (rotary tables sharded before the stages are
    exported) and HF LLaMA (causal mask folded, positions from aranges, labels shifted inside the
    loss: each shard reads the labels at its positions + 1)."""
    from tests import zoo
    from tests.test_torch_backend import LR, SEED, STEPS, _single
    from tests.test_torch_sp_pipeline import sharp_llama

    x, y = ex.gpt_data(0)
    s = pp.evaluate(sharp_llama(), (x, y), "local-cpu:4", batch_size=ex.BATCH, recompute="none", microbatches=2,
                    cp=2, pp=2, schedule="gpipe")
    assert [a.name for a in s.mesh.axes if a.size > 1] == ["pp", "cp"] and not s.search.notes
    log = train(s, sharp_llama, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    ref = _single(sharp_llama, ex.gpt_data)
    assert max(abs(r["loss"] - w) / abs(w) for r, w in zip(log, ref, strict=True)) <= 1e-6
    x, y = zoo.lm_data(0)
    s = pp.evaluate(zoo.hf_llama(), (x[:4], y[:4]), "local-cpu:4", batch_size=zoo.BATCH, recompute="none",
                    microbatches=2, cp=2, pp=2, schedule="gpipe")
    log = train(s, zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    ref = ex.single_process_losses(zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    err = max(abs(r["loss"] - w) / abs(w) for r, w in zip(log, ref, strict=True))
    print(f"HF LLaMA cp2 x pp2: max relative loss difference {err:.2e}")
    assert err <= 1e-6
