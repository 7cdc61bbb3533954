"""Which embeddings Megatron's rule splits as a vocabulary (``megatron_rule.vocabulary_lookups``),
checked on small modules whose answer is known by construction."""

from __future__ import annotations

import torch
from torch import nn

from polyparallel.cost_models.megatron_rule import vocabulary_lookups
from polyparallel.frontends import capture


class _Positions(nn.Module):
    """Token ids looked up in ``wte``; positions (an ``arange`` expanded *as* the ids: the ids give
    only the shape) in ``wpe``; a table indexed by computed ids (the ids plus an offset), which
    ``tied`` shares with the output layer."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.wte, self.wpe, self.shifted = nn.Embedding(32, 8), nn.Embedding(16, 8), nn.Embedding(40, 8)
        self.head = nn.Linear(8, 32, bias=False)
        if tied:
            self.shifted.weight = self.head.weight = nn.Parameter(torch.randn(32, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return self.head(self.wte(ids) + self.wpe(pos) + self.shifted(ids + 2))


def _vocabulary(model: nn.Module) -> set[str]:
    g = capture(model, (torch.randint(0, 16, (2, 8)),))
    return {g.op(name).module for name in vocabulary_lookups(g)}


def test_a_table_read_by_the_ids_is_a_vocabulary_and_positions_are_not() -> None:
    # the ids reach wpe's lookup only through expand_as's shape operand: not its values
    assert _vocabulary(_Positions(tied=False)) == {"wte"}


def test_a_table_the_output_layer_shares_is_a_vocabulary() -> None:
    assert _vocabulary(_Positions(tied=True)) == {"wte", "shifted"}
