"""A model family is one adapter plus one register_adapter call: a toy family defined here (its model and
its adapter) is found by adapter_for, planned within what it declares it cannot do, and trained by
auto_configure on 2 gloo ranks (Ulysses, full checkpointing, FSDP2) to the loss of the same model in
one process; the built-in families are still found, and unknown models and names are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec
from sp_plan.planner.plan import Hardware, Plan
from sp_plan.runtime.capabilities import memory_assumptions, merge_constraints, planner_constraints, unsupported_reasons
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.base import ModelAdapter, adapter_for, adapter_named, adapter_names, register_adapter
from tests.distributed import error_of, run_ranks

SEQ = 64
SPEC = ModelSpec(name="toy", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8,
                 ffn_hidden_size=64, vocab_size=64)
NO_TP = "the toy family has no tensor parallelism"
NO_TILED_MLP = "the toy family has no tiled MLP"


def _local_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unparallelised causal attention on (batch, seq, heads, head_dim), the toy's default."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class ToyBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.head_dim = spec.num_heads, spec.head_dim
        self.norm = nn.LayerNorm(spec.hidden_size)
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.num_heads * spec.head_dim)
        self.out = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(spec.hidden_size, spec.ffn_hidden_size), nn.GELU(),
                                 nn.Linear(spec.ffn_hidden_size, spec.hidden_size))
        self.attention_fn = _local_causal_attention
        self.checkpointed = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        x = x + self.out(self.attention_fn(q, k, v).reshape(b, s, -1))
        return x + self.mlp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=False) if self.checkpointed else self._forward(x)


class ToyLM(nn.Module):
    """A tiny pre-norm decoder with no position embedding (the causal mask orders the tokens)."""

    def __init__(self, spec: ModelSpec = SPEC) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(spec) for _ in range(spec.num_layers))
        self.norm = nn.LayerNorm(spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: Any = None, cu_seqlens: Any = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids))


class ToyAdapter(ModelAdapter):
    name = "toy"
    memory_assumptions = {"norm_implementation": "eager"}
    unsupported_degrees = {"tp": NO_TP}
    unsupported_options = {"tiled_mlp": NO_TILED_MLP, "offload_checkpoints": "the toy family keeps inputs on device"}

    def matches(self, model: Any) -> bool:
        return isinstance(model, ToyLM)

    def spec(self, model: nn.Module) -> ModelSpec:
        return model.spec

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def input_embedding(self, model: nn.Module) -> nn.Module:
        return model.embed

    def logits(self, model, input_ids, position_ids, cu_seqlens=None) -> torch.Tensor:
        if cu_seqlens is not None:
            raise RuntimeConfigError("the toy family has no document masking")
        return model(input_ids)

    def swap_attention(self, model: nn.Module, sp, seq_len: int) -> None:
        for block in model.blocks:
            block.attention_fn = sp.attention

    def set_checkpointing(self, model: nn.Module, mode: str, offload_inputs: bool) -> None:
        for block in model.blocks:
            block.checkpointed = mode != "none"  # selective and full both recompute the whole block


def _toy(seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM()


def _plan(layout: Layout, **train: Any) -> Plan:
    return Plan(model=SPEC, train=TrainSpec(seq_len=SEQ, dtype="fp32", **train), layout=layout,
                hardware=Hardware(num_gpus=layout.world, gpus_per_node=layout.world, gpu="h100-80gb",
                                  topology="dgx-h100"))


def _batch() -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(3))


def _reference_loss() -> float:
    ids = _batch()
    logits = _toy()(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, SPEC.vocab_size), ids[:, 1:].reshape(-1)).item()


def _rank(rank: int, world: int) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    register_adapter(ToyAdapter())  # each rank is a fresh process: register the family there
    out: dict[str, Any] = {}
    setup = auto_configure(_toy(), plan=_plan(Layout(ulysses=2), checkpointing="full"))
    out["family"] = (setup.adapter.name, setup.kind, setup.model is setup.model_parts[0], len(setup.model_parts))
    out["attention"] = [block.attention_fn == setup.sp.attention for block in setup.model.blocks]
    out["loss"] = train_step(setup, [_batch()]).loss
    tiled = auto_configure(_toy(), plan=_plan(Layout(ulysses=2), tiled_loss=True))
    out["tiled_loss"] = train_step(tiled, [_batch()]).loss
    out["tp_plan"] = error_of(lambda: auto_configure(_toy(), plan=_plan(Layout(tp=2))))
    out["tp_pin"] = error_of(lambda: auto_configure(_toy(), seq_len=SEQ, topology="dgx-h100", fixed_layout={"tp": 2}))
    return out


@pytest.fixture(scope="module")
def toy_registered():
    return register_adapter(ToyAdapter())


def test_a_registered_family_is_found_and_the_built_in_ones_still_are(toy_registered):
    from sp_plan.runtime.models import LlamaModel

    assert adapter_for(_toy()) is toy_registered
    assert adapter_named("toy") is toy_registered and adapter_named(toy_registered) is toy_registered
    assert {"llama", "hf", "toy"} <= set(adapter_names())
    assert adapter_for(LlamaModel(SPEC.model_copy(update={"hidden_size": 32}))).name == "llama"
    with pytest.raises(RuntimeConfigError, match="does not know how to parallelise a Linear"):
        adapter_for(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        adapter_named("nope")
    with pytest.raises(TypeError, match="ModelAdapter instance"):
        register_adapter(ToyAdapter)  # the class, not an instance


def test_what_a_family_cannot_do_reaches_the_planner_and_the_refusals(toy_registered):
    reasons = unsupported_reasons(_plan(Layout(tp=2), tiled_mlp=True), "toy")
    assert f"tp=2: {NO_TP}" in reasons and f"tiled_mlp: {NO_TILED_MLP}" in reasons
    assert unsupported_reasons(_plan(Layout(tp=2), tiled_mlp=True), "llama") == []
    layout, options = planner_constraints(toy_registered, SPEC)
    # pp: pipeline stages run only for the families the pipeline runtime knows (our Llama, HF), not a new one
    assert layout == {"tp": 1, "pp": 1} and options == {"tiled_mlp": False, "offload_checkpoints": False}
    with pytest.raises(RuntimeConfigError, match=NO_TILED_MLP):
        merge_constraints({}, {"tiled_mlp": True}, "toy", SPEC)
    assert memory_assumptions("toy").norm_implementation == "eager"


def test_plan_for_a_registered_family_respects_what_it_cannot_do(toy_registered):
    from sp_plan.cost_models.topology import default_topology
    from sp_plan.runtime.planning import plan_for

    plan = plan_for(SPEC, TrainSpec(seq_len=SEQ, dtype="fp32"), default_topology("h100-80gb", 2, 2), 2,
                    family="toy", fixed_options={"tiled_loss": True})
    assert plan.layout.tp == 1 and not plan.train.tiled_mlp and not plan.train.offload_checkpoints
    assert plan.estimate["detail"]["assumptions"]["norm_implementation"] == "eager"


@pytest.mark.multiproc
def test_auto_configure_trains_a_registered_family_on_two_ranks():
    reference = _reference_loss()
    for r in run_ranks(2, _rank, timeout=180):
        assert r["family"] == ("toy", "toy", True, 1)
        assert r["attention"] == [True, True]
        assert r["loss"] == pytest.approx(reference, rel=1e-5)
        assert r["tiled_loss"] == pytest.approx(reference, rel=1e-5)
        assert NO_TP in r["tp_plan"]
        assert NO_TP in r["tp_pin"]
