"""HF transformers models (random weights from a config, no download) train with our SP attention.

On 4 gloo ranks, for Llama, Qwen2 (QKV bias), Qwen3 (q/k norm) and Mistral configs under USP, Ulysses 4
(KV heads replicated), Ring 4 and data x sequence parallelism, through ``sp_plan.runtime.auto_configure``:

- the model's attention is ours (``attn_implementation == "sp_plan"``) and NO mask is ever built:
  transformers' mask builders are replaced by functions that fail the test if called, and our
  attention refuses any mask it is given;
- 3 AdamW steps match a single-process run of the same HF model with its own SDPA attention on the
  full sequences (default position ids there, our sharded global position ids here): loss curves
  within 1e-4, which also shows the position ids are respected (local positions would not match);
- the cost models see the same architecture (``model_from_hf_dict``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiproc

STEPS, BATCH, SEQ, VOCAB, LR = 3, 2, 64, 128, 1e-3
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, attention_dropout=0.0,
              tie_word_embeddings=False)
#: (case, family, config overrides, layout pins, option pins)
CASES = [
    ("llama", "llama", {}, {"ring": 2, "ulysses": 2},
     {"zero_stage": 3, "checkpointing": "selective", "tiled_loss": True, "offload_checkpoints": True}),
    ("qwen2", "qwen2", {"use_sliding_window": False}, {"dp_shard": 2, "ulysses": 2},
     {"zero_stage": 2, "checkpointing": "none", "tiled_mlp": True}),
    ("qwen3", "qwen3", {"head_dim": 16}, {"ulysses": 4}, {"zero_stage": 1, "checkpointing": "full", "offload_optimizer": True}),
    ("mistral", "mistral", {"sliding_window": None}, {"ring": 4},
     {"zero_stage": 3, "checkpointing": "full", "offload_params": True, "tiled_loss": True, "tiled_mlp": True}),
    # Tensor parallelism (Megatron SP) on HF models, composed with SP, FSDP and the memory techniques.
    ("llama tp2 x ulysses2", "llama", {}, {"tp": 2, "ulysses": 2},
     {"zero_stage": 3, "checkpointing": "selective", "tiled_mlp": True, "tiled_loss": True}),
    ("qwen3 tp4 (KV heads replicated, q/k norms)", "qwen3", {"head_dim": 16}, {"tp": 4},
     {"zero_stage": 2, "checkpointing": "full"}),
    ("qwen2 tp2 x ring2 (QKV bias)", "qwen2", {"use_sliding_window": False}, {"tp": 2, "ring": 2},
     {"zero_stage": 1, "checkpointing": "none", "offload_optimizer": True}),
    ("llama tied tp2 x dp2", "llama", {"tie_word_embeddings": True}, {"tp": 2, "dp_shard": 2},
     {"zero_stage": 3, "checkpointing": "full", "offload_params": True, "tiled_loss": True}),
]


def _hf_model(family: str, overrides: dict, attn: str):
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[family]
    config = config_cls(**{**COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.float()


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    start = torch.randint(0, VOCAB, (STEPS, BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (STEPS, BATCH, 1), generator=gen)
    return list((start + stride * torch.arange(SEQ)) % VOCAB)


def _reference(family: str, overrides: dict, with_params: bool = False):
    import torch.nn.functional as F

    model = _hf_model(family, overrides, "sdpa")
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in _data():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if with_params:
        return losses, initial, {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses


def _fail_mask(*args, **kwargs):
    raise AssertionError("transformers built an attention mask for the sequence-parallel model")


def _rank(rank: int, world: int) -> dict:
    from transformers import masking_utils

    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.hf import ATTENTION_NAME, TILED_ATTRIBUTE, hf_model_spec
    from sp_plan.runtime.step import train_step

    for name in list(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):
        masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name] = _fail_mask
    results = {}
    for case, family, overrides, layout, options in CASES:
        model = _hf_model(family, overrides, "eager")
        spec = hf_model_spec(model)
        setup = auto_configure(model, seq_len=SEQ, micro_batch=BATCH, global_batch=BATCH, dtype="fp32",
                               topology="dgx-h100", fixed_layout=layout, fixed_options=options)
        assert setup.model.config._attn_implementation == ATTENTION_NAME
        optimizer = setup.make_optimizer(lr=LR)
        per_rank = BATCH // setup.dp_size
        losses = []
        for ids in _data():
            mine = ids[setup.dp_rank * per_rank:(setup.dp_rank + 1) * per_rank]
            micro = [mine[i:i + setup.train.micro_batch] for i in range(0, per_rank, setup.train.micro_batch)]
            losses.append(train_step(setup, micro, optimizer).loss)
        refused = None
        try:
            shard = setup.shard(_data()[0][:per_rank])
            setup.model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                        attention_mask=torch.zeros(per_rank, 1, shard["input_ids"].shape[1],
                                                   shard["input_ids"].shape[1], dtype=torch.bool), use_cache=False)
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            refused = str(exc)
        # Under TP every parameter's update must match too (Adam's per-element normalisation hides a
        # gradient that is off by a constant factor from the loss curve, e.g. an unsynchronised norm).
        full = setup.full_state_dict() if "tp" in layout else None
        # numpy arrays pickle by value (torch tensors would travel as shared-memory handles)
        params = {k: v.cpu().numpy() for k, v in full.items()} if full is not None and rank == 0 else None
        offload = setup.checkpoint_offload
        tiled = [getattr(layer.mlp, TILED_ATTRIBUTE, False) for layer in setup.model.model.layers]
        q_proj = setup.model.model.layers[0].self_attn.q_proj.weight
        q_rows = q_proj.full_tensor().shape[0] if hasattr(q_proj, "full_tensor") else q_proj.shape[0]
        results[case] = {"losses": losses, "spec": spec.model_dump(), "layout": setup.layout.describe(),
                           "refused": refused, "optimizer": type(optimizer).__name__, "tiled_mlps": sum(tiled),
                           "tp_sharded": q_rows < spec.q_size, "params": params,
                           "checkpoint_bytes_offloaded": offload.offloaded_bytes if offload is not None else 0}
    return results


@pytest.fixture(scope="module")
def trained():
    return run_ranks(4, _rank, timeout=180)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_hf_model_trains_like_single_process_hf(case, trained):
    family, overrides = next((c[1], c[2]) for c in CASES if c[0] == case)
    reference = _reference(family, overrides)
    for rank in trained:
        got = rank[case]["losses"]
        diff = sum(abs(a - b) for a, b in zip(got, reference)) / STEPS
        assert diff < 1e-4, (case, rank[case]["layout"], got, reference)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_hf_attention_refuses_a_4d_mask_and_maps_the_architecture(case, trained):
    family = next(c[1] for c in CASES if c[0] == case)
    result = trained[0][case]
    assert "mask" in (result["refused"] or "")
    spec = result["spec"]
    assert spec["num_layers"] == 2 and spec["num_heads"] == 4 and spec["num_kv_heads"] == 2
    assert spec["qk_norm"] == (family == "qwen3") and spec["qkv_bias"] == (family == "qwen2")


@pytest.mark.parametrize("case", [c[0] for c in CASES if "tp" in c[3]])
def test_hf_tensor_parallel_parameter_updates_match_single_process(case, trained):
    family, overrides = next((c[1], c[2]) for c in CASES if c[0] == case)
    _, initial, reference = _reference(family, overrides, with_params=True)
    got = {k: torch.from_numpy(v) for k, v in trained[0][case]["params"].items()}
    assert got.keys() == reference.keys()
    for name, ref in reference.items():
        update = (ref - initial[name]).norm()
        error = (got[name] - ref).norm()
        assert error <= 1e-3 * update + 1e-7, (case, name, float(error), float(update))


def test_hf_memory_techniques_and_tensor_parallelism_ran(trained):
    """Tiled MLP and loss, checkpoint offload, the optimizer offloads and TP on HF models (the equal loss
    curves above would also hold if they were silently skipped)."""
    first = trained[0]
    assert first["llama"]["checkpoint_bytes_offloaded"] > 0
    assert [first[c[0]]["tiled_mlps"] for c in CASES] == [0, 2, 0, 2, 2, 0, 0, 0]
    assert first["qwen3"]["optimizer"] == "HostOffloadOptimizer"
    assert first["mistral"]["optimizer"] == "AdamW" and first["qwen2"]["checkpoint_bytes_offloaded"] == 0
    for case, _, _, layout, _ in CASES:
        assert first[case]["layout"].count("tp=") == ("tp" in layout), case
        if "tp" in layout:
            assert first[case]["tp_sharded"], case  # the projections really are this rank's shards
