"""Which Linears Megatron's rule splits by columns (``megatron_rule.paired_columns``), checked on small
modules whose answer is known by construction, and what the torch backend makes of the rule's plan.

The rule used to split every Linear that reads a whole tensor by columns. An input projection before
the blocks (ELECTRA's ``embeddings_project``) feeds the residual stream and a norm, which take no
shard: the split then put every later Linear out of phase (the blocks' ``query`` row-parallel, their
output projections column-parallel, attention whole), a plan priced for collectives that cannot
happen and refused by the backend ("row-parallel Linear ... reads an input that no column-parallel
Linear ... leaves split").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyparallel.backends.torch import _examples as ex
from polyparallel.cost_models import ParallelConfig
from polyparallel.cost_models.megatron_rule import op_plans, paired_columns
from polyparallel.frontends import capture
from tests.test_torch_tp import _loss_gap
from tests.test_tp_traced_blocks import _plan


class InputProjection(nn.Module):
    """Token embedding of width 16, a projection to 32 (``proj``), one residual MLP block (``fc``,
    GELU, ``out``), a norm (unless ``norm`` is False), the output layer (``head``)."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.proj = nn.Linear(16, 32)
        self.fc, self.out = nn.Linear(32, 64), nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32) if norm else nn.Identity()
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.wte(ids))
        h = self.norm(h + self.out(nn.functional.gelu(self.fc(h))))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def input_projection() -> InputProjection:
    torch.manual_seed(0)
    return InputProjection()


def test_an_input_projection_stays_whole_and_the_block_is_a_megatron_pair() -> None:
    x, y = ex.gpt_data(0)
    g = capture(input_projection(), (x, y))
    assert {g.op(n).module for n in paired_columns(g)} == {"fc", "head"}
    # without the norm the projection still feeds the residual add, beside the block's output
    assert {g.op(n).module for n in paired_columns(capture(InputProjection(norm=False), (x, y)))} == {"fc", "head"}
    plans = dict(zip((op.module for op in g.ops), op_plans(g, ParallelConfig(tp=2))))
    assert plans["proj"].split == 1 and not plans["proj"].tp_fwd + plans["proj"].tp_bwd  # whole: no collective
    assert plans["fc"].split == 2 and [c for c, _ in plans["fc"].tp_bwd] == ["all_reduce"]  # column-parallel
    assert plans["out"].split == 2 and [c for c, _ in plans["out"].tp_fwd] == ["all_reduce"]  # its row partner


class Routed(nn.Module):
    """An MLP block scaled by a router's softmax (an MoE's gate, one expert): the router's logits are
    normalised over all its outputs, which no rank holds alone."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.router, self.fc, self.out = nn.Linear(32, 4), nn.Linear(32, 64), nn.Linear(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        gate = torch.softmax(self.router(h), dim=-1)[..., :1]
        h = h + self.out(nn.functional.gelu(self.fc(h))) * gate
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_router_normalised_by_a_softmax_stays_whole() -> None:
    x, y = ex.gpt_data(0)
    g = capture(Routed(), (x, y))
    assert {g.op(n).module for n in paired_columns(g)} == {"fc", "head"}


def test_the_rules_plan_for_an_input_projection_is_what_the_torch_backend_runs() -> None:
    s, plan = _plan(input_projection, ex.gpt_data)
    assert not any(n.startswith("planning only") for n in s.search.notes)
    kinds = dict(plan.tp_plan)
    assert "proj" not in kinds and (kinds["fc"], kinds["out"], kinds["head"]) == ("col", "row", "col_to_loss")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_rules_plan_for_an_input_projection_trains_as_one_process() -> None:
    s, _ = _plan(input_projection, ex.gpt_data)
    assert _loss_gap(s, input_projection, ex.gpt_data, "input projection + MLP block") <= 1e-5
