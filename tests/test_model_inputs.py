"""pp.search(model) with no example inputs: where the model says what it takes, the inputs are
inferred, and the strategy is the one the same inputs given by hand produce (same fingerprint)."""

from __future__ import annotations

import pytest
import torch

import polyparallel as pp
from polyparallel.models import GPT, GPTConfig
from polyparallel.planning.model_inputs import INFERRED_BATCH


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, seq=16, layers=1, hidden=32, heads=2))


def _llama() -> torch.nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                              max_position_embeddings=16))


CASES = [
    (_mlp, lambda: ((torch.zeros(INFERRED_BATCH, 12),), {})),
    (_gpt, lambda: ((torch.zeros(INFERRED_BATCH, 16, dtype=torch.long),),
                    {"labels": torch.zeros(INFERRED_BATCH, 16, dtype=torch.long)})),
    (_llama, lambda: ((), {"input_ids": torch.zeros(INFERRED_BATCH, 16, dtype=torch.long),
                           "labels": torch.zeros(INFERRED_BATCH, 16, dtype=torch.long), "use_cache": False})),
]


@pytest.mark.parametrize(("build", "by_hand"), CASES, ids=["linear-first", "embedding-first", "hf-llama"])
def test_inferred_inputs_give_the_plan_of_the_same_inputs_by_hand(build, by_hand) -> None:
    inferred = pp.search(build(), cluster="local-cpu:2")
    args, kwargs = by_hand()
    given = pp.search(build(), args, "local-cpu:2", example_kwargs=kwargs)
    assert "example inputs inferred" in inferred.search.notes[0]
    assert inferred.model.fingerprint == given.model.fingerprint
    assert (inferred.dp, inferred.tp, inferred.pp, inferred.global_batch) == \
        (given.dp, given.tp, given.pp, given.global_batch)
