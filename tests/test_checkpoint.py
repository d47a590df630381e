"""Checkpoint and resume (sp_plan.runtime.checkpoint through sp_plan.runtime.trainer.Trainer) on gloo CPU ranks.

- Same layout: a run saved at step 2 and resumed in fresh processes continues bit-exactly: the losses of
  steps 3-4, the final model, optimizer states and host masters (compared tensor by tensor in the final
  checkpoints) and the RNG draws after the resume equal the uninterrupted run's. Layouts: ring 2 with
  ZeRO-3, selective checkpointing and gradient accumulation; TP 2 with replicated K/V weights (1 KV
  head), the host-offloaded optimizer and the tiled loss; dp_shard 2 with FSDP2 parameter offload; Ulysses
  2 in bf16 with the host optimizer (bf16 device weights, fp32 masters); a transformers Llama with tied
  embeddings under TP 2.
- Another layout: a checkpoint of tp 2 x dp_shard 2 on 4 ranks (host optimizer) resumes on 2 ranks as
  ring 2 and as dp_shard 2 with plain AdamW (another world size, no TP, another data-parallel size):
  the loss curve continues within 1e-4 of the uninterrupted 4-rank run, the parameters' updates within
  0.2% (the equivalence tests' fp32 bound).
- Atomicity: a save interrupted after DCP wrote its files (before the rename), or while DCP writes, is
  never the latest; the next save cleans it up. Errors: another model's checkpoint, an incomplete
  checkpoint, a missing path, data that changed, a forged .metadata pickle.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import random

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks

SEQ = 64
VOCAB = 97  # odd: uneven vocab-parallel and FSDP chunks
LR = 1e-2
STEPS = 4
SAVE_AT = 2
LOSS_TOL = 1e-4
FP32_UPDATE_TOL = 2e-3


def spec(**overrides):
    from sp_plan.cost_models import ModelSpec

    fields = dict(name="tiny-ckpt", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=16,
                  ffn_hidden_size=96, vocab_size=VOCAB)
    return ModelSpec(**{**fields, **overrides})


def model(**overrides):
    from sp_plan.runtime.models import LlamaModel

    m = LlamaModel(spec(**overrides))
    m.init_weights(generator=torch.Generator().manual_seed(0))
    return m


def dataset(sequences: int = 48):
    """Learnable windows: arithmetic progressions mod VOCAB whose stride changes every 16 tokens."""
    from sp_plan.runtime.data import TokenWindows

    n = sequences * SEQ
    t = torch.arange(n)
    stream = (t * (1 + (t // 16) % 5) + t // 97) % VOCAB
    return TokenWindows(stream, SEQ)


def trainer_for(setup, *, steps: int = STEPS, **kwargs):
    """A Trainer over the test data with a warm-up schedule, clipping and quiet output."""
    from sp_plan.runtime.text_data import GlobalBatches
    from sp_plan.runtime.trainer import Trainer

    optimizer = setup.make_optimizer(lr=LR, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    data = GlobalBatches.for_setup(setup, dataset(), seed=1)
    kwargs = {"progress": False, "log_every": 0, "print_fn": lambda _: None, "keep_checkpoints": None, **kwargs}
    return Trainer(setup, optimizer, data, max_steps=steps, scheduler=schedule, max_grad_norm=1.0, **kwargs)


def configure(layout: dict, options: dict, dtype: str = "fp32", global_batch: int = 2, hf: bool = False,
              **model_overrides):
    from sp_plan.runtime.auto import auto_configure

    if hf:  # a transformers Llama of the same shape (names like model.layers.0.self_attn.q_proj.weight)
        from sp_plan.runtime.hf import hf_model_from_spec

        torch.manual_seed(0)
        net = hf_model_from_spec(spec(**model_overrides), SEQ)
    else:
        net = model(**model_overrides)
    return auto_configure(net, seq_len=SEQ, global_batch=global_batch, dtype=dtype, topology="dgx-h100",
                          fixed_layout=layout, fixed_options=options)


def _rng_draws(store: dict):
    def on_step(trainer, record):
        if record.step == SAVE_AT + 1:  # after the resume point: the restored RNG states must give these
            store["draws"] = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    return on_step


def _train_runs(rank: int, world: int, runs: list[dict]) -> dict:
    torch.manual_seed(0)
    out = {}
    for run in runs:
        setup = configure(run["layout"], run["options"], run.get("dtype", "fp32"), run.get("global_batch", 2),
                          **run.get("model", {}))
        store: dict = {}
        trainer = trainer_for(setup, checkpoint_dir=run["dir"], save_every=SAVE_AT, resume=run.get("resume", False),
                              on_step=_rng_draws(store))
        fit = trainer.fit()
        out[run["name"]] = {"losses": fit.losses, "start": fit.start_step, "draws": store.get("draws"),
                            "optimizer": type(trainer.optimizer).__name__, "layout": setup.plan.layout.describe(),
                            "grad_accum": setup.train.grad_accum, "dtype": str(next(setup.model.parameters()).dtype)}
    return out


#: name -> (layout, options, dtype[, model options])
SAME_LAYOUT = {
    "ring2 zero3 selective accum": ({"ring": 2}, {"zero_stage": 3, "checkpointing": "selective"}, "fp32"),
    "tp2 kv-replicated host-optimizer tiled-loss": ({"tp": 2}, {"zero_stage": 2, "offload_optimizer": True,
                                                                "tiled_loss": True}, "fp32"),
    "dp_shard2 param-offload": ({"dp_shard": 2}, {"zero_stage": 3, "offload_params": True,
                                                  "offload_optimizer": True}, "fp32"),
    "ulysses2 bf16 host-optimizer": ({"ulysses": 2}, {"zero_stage": 3, "offload_optimizer": True}, "bf16"),
}
if importlib.util.find_spec("transformers") is not None:
    SAME_LAYOUT["hf llama tp2 tied"] = ({"tp": 2}, {"zero_stage": 3}, "fp32",
                                        {"hf": True, "tied_embeddings": True, "num_kv_heads": 2})


def _slug(name: str) -> str:
    return name.replace(" ", "_")


@pytest.fixture(scope="module")
def same_layout_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("same-layout")
    runs = [{"name": n, "layout": c[0], "options": c[1], "dtype": c[2], "model": c[3] if len(c) > 3 else {},
             "dir": str(root / ("full-" + _slug(n)))} for n, c in SAME_LAYOUT.items()]
    full = run_ranks(2, _train_runs, runs, timeout=240)
    resumed_runs = [{**r, "dir": str(root / ("resumed-" + _slug(r["name"]))),
                     "resume": os.path.join(r["dir"], f"step_{SAVE_AT:08d}")} for r in runs]
    resumed = run_ranks(2, _train_runs, resumed_runs, timeout=240)
    return root, full, resumed


def _all_tensors(path) -> dict[str, torch.Tensor]:
    from sp_plan.runtime.checkpoint import load_full_state_dict, read_metadata

    prefixes = {k.split("::")[0] for k in read_metadata(path).state_dict_metadata}
    return {f"{p}::{k}": v for p in prefixes for k, v in load_full_state_dict(path, prefix=p).items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SAME_LAYOUT))
def test_resume_on_the_same_layout_is_bit_exact(name, same_layout_runs):
    root, full, resumed = same_layout_runs
    f, r = full[0][name], resumed[0][name]
    assert f["start"] == 0 and r["start"] == SAVE_AT
    assert len(f["losses"]) == STEPS and f["losses"][-1] < f["losses"][0]  # it trains
    assert r["losses"] == f["losses"][SAVE_AT:], (f["losses"], r["losses"])  # bit-exact, not close
    assert r["draws"] == f["draws"] and r["draws"] is not None  # torch, Python and NumPy RNG restored
    assert all(result[name]["losses"] == f["losses"] for result in full)  # every rank agrees
    saved = _all_tensors(root / ("full-" + _slug(name)) / f"step_{STEPS:08d}")
    again = _all_tensors(root / ("resumed-" + _slug(name)) / f"step_{STEPS:08d}")
    assert saved.keys() == again.keys()
    assert any(k.startswith("optim::") and k.endswith("::exp_avg_sq") for k in saved)
    different = [k for k in saved if not torch.equal(saved[k], again[k])]
    assert not different, different[:5]


@pytest.mark.multiproc
def test_the_configurations_ran_what_they_claim(same_layout_runs):
    _, full, _ = same_layout_runs
    runs = full[0]
    assert runs["tp2 kv-replicated host-optimizer tiled-loss"]["optimizer"] == "HostOffloadOptimizer"
    assert runs["ulysses2 bf16 host-optimizer"]["dtype"] == "torch.bfloat16"
    assert runs["ring2 zero3 selective accum"]["grad_accum"] == 2
    assert runs["dp_shard2 param-offload"]["layout"] == "dp_shard=2"
    root = same_layout_runs[0]
    keys = _all_tensors(root / ("full-" + _slug("ulysses2 bf16 host-optimizer")) / f"step_{STEPS:08d}")
    assert keys["master::layers.0.attn.q_proj.weight"].dtype == torch.float32  # fp32 masters saved
    assert keys["model::layers.0.attn.q_proj.weight"].dtype == torch.bfloat16
    # the saved tensors are the unparallelised model's, whatever the layout
    tp = _all_tensors(root / ("full-" + _slug("tp2 kv-replicated host-optimizer tiled-loss")) / f"step_{STEPS:08d}")
    assert tp["model::layers.0.attn.k_proj.weight"].shape == (16, 64)  # 1 KV head, replicated over TP 2
    assert tp["model::embed_tokens.weight"].shape == (VOCAB, 64)
    if "hf llama tp2 tied" not in SAME_LAYOUT:
        return
    hf = _all_tensors(root / ("full-" + _slug("hf llama tp2 tied")) / f"step_{STEPS:08d}")
    assert torch.equal(hf["model::lm_head.weight"], hf["model::model.embed_tokens.weight"])  # still tied
    assert hf["model::model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)


# ----- another layout ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_layout_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("other-layout")
    source = {"name": "tp2 x dp_shard2", "layout": {"tp": 2, "dp_shard": 2},
              "options": {"zero_stage": 3, "offload_optimizer": True}, "global_batch": 4, "dir": str(root / "src")}
    full = run_ranks(4, _train_runs, [source], timeout=240)
    resume = os.path.join(source["dir"], f"step_{SAVE_AT:08d}")
    targets = [
        {"name": "ring2", "layout": {"ring": 2}, "options": {"zero_stage": 2}, "global_batch": 4,
         "dir": str(root / "ring2"), "resume": resume},
        {"name": "dp_shard2", "layout": {"dp_shard": 2}, "options": {"zero_stage": 3}, "global_batch": 4,
         "dir": str(root / "dp2"), "resume": resume},
    ]
    resumed = run_ranks(2, _train_runs, targets, timeout=240)
    return root, full[0]["tp2 x dp_shard2"], resumed[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ring2", "dp_shard2"])
def test_resume_on_another_layout_continues_the_loss_curve(name, other_layout_runs):
    from sp_plan.runtime.checkpoint import load_full_state_dict

    root, source, resumed = other_layout_runs
    got = resumed[name]
    assert source["optimizer"] == "HostOffloadOptimizer" and got["optimizer"] == "AdamW"
    assert got["start"] == SAVE_AT and got["grad_accum"] == (4 if name == "ring2" else 2)
    diffs = [abs(a - b) for a, b in zip(got["losses"], source["losses"][SAVE_AT:])]
    assert len(diffs) == STEPS - SAVE_AT and max(diffs) < LOSS_TOL, (source["losses"], got["losses"])
    start = load_full_state_dict(root / "src" / f"step_{SAVE_AT:08d}")
    reference = load_full_state_dict(root / "src" / f"step_{STEPS:08d}")
    final = load_full_state_dict(root / ("ring2" if name == "ring2" else "dp2") / f"step_{STEPS:08d}")
    worst = max(((final[k] - reference[k]).norm() / (reference[k] - start[k]).norm()).item() for k in reference)
    assert worst < FP32_UPDATE_TOL, worst


# ----- atomicity and errors (one rank) ----------------------------------------------------------------------


def _atomicity_and_errors(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import sp_plan.runtime.checkpoint as ck
    from sp_plan.runtime.checkpoint import store
    from sp_plan.runtime.errors import RuntimeConfigError

    out: dict = {}
    setup = configure({}, {"zero_stage": 3})
    trainer = trainer_for(setup, steps=1, checkpoint_dir=root)
    trainer.fit()  # step 1, complete
    full = {n: t.clone() for n, t in setup.full_state_dict().items()}
    out["params_match"] = all(torch.equal(full[n], t) for n, t in ck.load_full_state_dict(root).items())

    def interrupted(step: int, where: str) -> None:
        trainer.step = step
        if where == "rename":  # killed after every file was written, before the rename
            original, store.os.replace = store.os.replace, _raise_killed
        else:  # killed while DCP writes the data files
            original, dcp.FileSystemWriter.write_data = dcp.FileSystemWriter.write_data, _raise_killed
        try:
            trainer.save()
        except BaseException as exc:  # DCP wraps it in a CheckpointException (a BaseException)
            out[f"error_{where}"] = f"{type(exc).__name__}: {exc}"
        finally:
            if where == "rename":
                store.os.replace = original
            else:
                dcp.FileSystemWriter.write_data = original

    interrupted(2, "rename")
    out["latest_after_rename_kill"] = str(ck.latest_checkpoint(root))
    out["leftovers"] = sorted(os.listdir(root))
    interrupted(3, "write")
    out["latest_after_write_kill"] = str(ck.latest_checkpoint(root))
    trainer.step = 4
    trainer.save()
    out["after_next_save"] = sorted(os.listdir(root))

    def error(fn) -> str:
        try:
            fn()
        except RuntimeConfigError as exc:
            return str(exc)
        return "no error"

    other = configure({}, {"zero_stage": 3}, hidden_size=32, head_dim=8)
    out["other_model"] = error(lambda: ck.load_checkpoint(root, setup=other))
    os.makedirs(os.path.join(root, "step_00000009"))
    open(os.path.join(root, "step_00000009", ".metadata"), "wb").close()
    out["incomplete"] = error(lambda: ck.load_checkpoint(os.path.join(root, "step_00000009"), setup=setup))
    out["latest_ignores_incomplete"] = str(ck.latest_checkpoint(root))
    out["missing"] = error(lambda: ck.load_checkpoint(os.path.join(root, "nope"), setup=setup))
    changed = trainer_for(setup, checkpoint_dir=root, resume=True)
    changed.data.num_sequences += 1  # the data set changed size since the save
    out["other_data"] = error(changed.fit)
    out["no_dir"] = error(lambda: trainer_for(setup, resume=True))
    return out


def _raise_killed(*args, **kwargs):
    raise RuntimeError("killed mid-save")


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("atomic")
    return root, run_ranks(1, _atomicity_and_errors, str(root / "ckpt"), timeout=180)[0]


@pytest.mark.multiproc
def test_an_interrupted_save_is_never_the_latest(single_rank):
    _, out = single_rank
    assert out["params_match"]  # load_full_state_dict gives the unparallelised model
    assert out["latest_after_rename_kill"].endswith("step_00000001")
    # a failure the process survives removes its partial save (a SIGKILL's is removed by the next save:
    # tests/test_checkpoint_faults.py) and is one line, DCP's CheckpointException included
    assert not any(name.startswith(".step_00000002.tmp-") for name in out["leftovers"]), out["leftovers"]
    assert out["latest_after_write_kill"].endswith("step_00000001")
    for where in ("rename", "write"):
        error = out[f"error_{where}"]
        assert error.startswith("RuntimeConfigError: saving checkpoint") and "killed mid-save" in error, error
        assert "\n" not in error and "CheckpointException" not in error and "partial save was removed" in error
    assert out["after_next_save"] == ["step_00000001", "step_00000004"]  # temporaries removed


@pytest.mark.multiproc
def test_bad_checkpoints_get_one_clear_error(single_rank):
    _, out = single_rank
    assert "saved for tiny-ckpt, not this model" in out["other_model"] and "hidden_size" in out["other_model"]
    assert "incomplete" in out["incomplete"] and "manifest.json" in out["incomplete"]
    assert out["latest_ignores_incomplete"].endswith("step_00000004")
    assert "does not exist" in out["missing"]
    assert "refers to other data" in out["other_data"] and "num_sequences" in out["other_data"]
    assert "checkpoint directory" in out["no_dir"]


def test_a_forged_metadata_pickle_is_refused(tmp_path):
    from sp_plan.runtime.checkpoint import read_metadata
    from sp_plan.runtime.errors import RuntimeConfigError

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(RuntimeConfigError, match="refusing to read it"):
        read_metadata(tmp_path)
