"""The runtime trains a model split into parts (the units pipeline stages are made of) as it trains the
whole model: :func:`sp_plan.runtime.model_parts.split_model` cuts a tiny Llama (the runtime's own, and an
HF one) into embedding + first half of the blocks and second half + norm + head, and
:func:`sp_plan.runtime.auto.configure_parts` parallelises each part.

- One process: ``train_step`` over the two parts gives exactly the one-part loss and gradients.
- Two gloo ranks with TP 2 (both families): the TP gradient clipping over the two parts clips by the one-part norm, and
  the loss and the clipped gradients match the one-part run.
- Bad boundaries and tied embeddings are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec
from sp_plan.planner.plan import Hardware, Plan
from tests.distributed import error_of, run_ranks

pytestmark = pytest.mark.multiproc

SEQ, VOCAB = 32, 64
SPEC = ModelSpec(name="tiny-llama", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                 ffn_hidden_size=64, vocab_size=VOCAB)


def _plan(spec: ModelSpec, layout: Layout) -> Plan:
    return Plan(model=spec, train=TrainSpec(seq_len=SEQ, dtype="fp32", zero_stage=3, checkpointing="selective"),
                layout=layout, hardware=Hardware(num_gpus=layout.world, gpus_per_node=layout.world,
                                                 gpu="h100-80gb", topology="dgx-h100"))


def _llama(tied: bool = False):
    from sp_plan.runtime.models.llama.model import LlamaModel

    model = LlamaModel(SPEC.model_copy(update={"tied_embeddings": tied}))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _hf_llama():
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(2)]


def _full_grads(setup) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in setup.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if setup.tensor_parallel is not None:
            grad = setup.tensor_parallel.full_tensor(name, grad)
        out[name] = grad.detach().numpy().copy()  # by value: a tensor would be shared through its rank's memory
    return out


def _step(family: str, layout: Layout, bounds: list[int] | None, max_grad_norm: float | None) -> dict:
    from sp_plan.runtime.auto import configure_parts
    from sp_plan.runtime.model_parts import split_model
    from sp_plan.runtime.models.base import adapter_for
    from sp_plan.runtime.step import train_step

    model = _llama() if family == "llama" else _hf_llama()
    adapter = adapter_for(model)
    spec = adapter.spec(model)
    parts = split_model(model, adapter, bounds) if bounds else [model]
    setup = configure_parts(parts, adapter, _plan(spec, layout))
    result = train_step(setup, _batches(), max_grad_norm=max_grad_norm)
    return {"parts": len(setup.model_parts), "loss": result.loss, "grad_norm": result.grad_norm,
            "grads": _full_grads(setup)}


def _one_and_two_parts(rank: int, world: int, family: str, layout: Layout, max_grad_norm: float | None,
                       bounds: tuple[int, ...] = (2,)) -> tuple[dict, dict]:
    """The step on the whole model, then on the same model split at ``bounds`` (same ranks, fresh setups)."""
    return (_step(family, layout, None, max_grad_norm), _step(family, layout, list(bounds), max_grad_norm))


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_two_parts_step_equals_one_part_exactly(family: str) -> None:
    if family == "hf":
        pytest.importorskip("transformers")
    one, two = run_ranks(1, _one_and_two_parts, family, Layout(), None)[0]
    assert (one["parts"], two["parts"]) == (1, 2)
    assert two["loss"] == one["loss"]
    assert sorted(two["grads"]) == sorted(one["grads"])  # the parts keep the whole model's names
    for name, grad in one["grads"].items():
        assert (two["grads"][name] == grad).all(), name


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_parts_of_the_embedding_alone_and_the_head_alone_step_like_one_part(family: str) -> None:
    """Llama 3's 405B layout puts the embedding and the loss in model chunks of their own."""
    if family == "hf":
        pytest.importorskip("transformers")
    one, four = run_ranks(1, _one_and_two_parts, family, Layout(), None, (0, 2, 4))[0]
    assert four["parts"] == 4 and four["loss"] == one["loss"]
    for name, grad in one["grads"].items():
        assert (four["grads"][name] == grad).all(), name


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_tp_clipping_over_two_parts_equals_one_part(family: str) -> None:
    if family == "hf":
        pytest.importorskip("transformers")
    for one, two in run_ranks(2, _one_and_two_parts, family, Layout(tp=2), 0.05):
        assert one["grad_norm"] > 0.05  # the clip is active
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)
        for name, grad in one["grads"].items():
            torch.testing.assert_close(torch.from_numpy(two["grads"][name]), torch.from_numpy(grad), rtol=1e-5,
                                       atol=1e-7, msg=name)


def test_split_refusals() -> None:
    from sp_plan.runtime.model_parts import split_model
    from sp_plan.runtime.models.base import adapter_for

    model = _llama()
    adapter = adapter_for(model)
    for bounds in ([-1], [5], [3, 2], [2, 2], []):
        error = error_of(lambda b=bounds: split_model(model, adapter, b))
        assert error is not None and "strictly between 0 and 4" in error, bounds
    # 0 first: a part of the embedding alone; the block count last: one of the norm, head and loss alone
    assert [len(list(p.layers)) for p in split_model(model, adapter, [0, 2, 4])] == [0, 2, 2, 0]
    tied = _llama(tied=True)
    assert "untie them" in error_of(lambda: split_model(tied, adapter_for(tied), [2]))
    parts = split_model(model, adapter, [1, 3])
    assert [len(list(p.layers)) for p in parts] == [1, 2, 1]
    assert len(list(model.layers)) == 4 and isinstance(model.embed_tokens, torch.nn.Embedding)  # untouched
