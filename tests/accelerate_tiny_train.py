"""A tiny training script for `accelerate launch --config_file <export>` in tests/test_export_accelerate.py.

Trains a 2-layer Llama for two optimizer steps with the Accelerator the launcher configures, and
writes one JSON file per rank (TINY_OUT/rank<N>.json; ranks share stdout, so their lines can
interleave) with what Accelerate set up (distributed type, parallelism sizes, gradient accumulation)
so the test can compare it with the plan.

FSDP exports on CPU ranks: Accelerate (1.15) gives the FSDP distributed type only to accelerator devices
(``AcceleratorState`` lists MULTI_GPU, MULTI_NPU, ... and never MULTI_CPU), so an FSDP config launched on
CPU ends as one process ("ParallelismConfig total_size (2) does not match num_processes (1)"). With
TINY_FSDP_ON_CPU=1 the script reports the launcher's gloo ranks as a GPU-type group on the cpu device
(:func:`_fsdp_on_cpu`: the device detection only); the YAML, the launcher, the FSDP2 plugin built from
its environment, ``accelerator.prepare`` (fully_shard) and the mixed precision are Accelerate's own.
"""

import json
import os

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

SEQ = int(os.environ.get("TINY_SEQ", "32"))
MICRO_BATCH = int(os.environ.get("TINY_MICRO_BATCH", "1"))
GRAD_ACCUM = int(os.environ.get("TINY_GRAD_ACCUM", "1"))


def _no_shm_kernel() -> None:
    """DeepSpeed on CPU compiles a shared-memory all-reduce kernel on first use (about a minute on 2 cores);
    it only speeds up inference, so tests skip it (TINY_NO_SHM=1) and gloo does the communication."""
    if os.environ.get("TINY_NO_SHM") == "1":
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _fsdp_on_cpu() -> None:
    """Let Accelerate's FSDP path run on CPU gloo ranks: its backend detection answers (gloo, a GPU-type
    group) and its device is the cpu (see the module doc)."""
    if os.environ.get("TINY_FSDP_ON_CPU") != "1":
        return
    import accelerate.state as state
    from accelerate.utils import DistributedType

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_GPU

    def set_device(self):
        self.device = torch.device("cpu")

    state.PartialState._prepare_backend = prepare_backend
    state.PartialState.set_device = set_device


def main() -> None:
    _no_shm_kernel()
    _fsdp_on_cpu()
    # What the export's notes tell the script to set: the DataLoader's batch size and the accumulation.
    accelerator = Accelerator(gradient_accumulation_steps=GRAD_ACCUM)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (8, SEQ), generator=torch.Generator().manual_seed(1))
    # position_ids: ALST shards the sequence and needs every token's global position.
    rows = [{"input_ids": r, "labels": r, "position_ids": torch.arange(SEQ)} for r in ids]
    loader = torch.utils.data.DataLoader(rows, batch_size=MICRO_BATCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    losses = []
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            if "shift_labels" in batch:  # Ulysses (ALST): each rank holds a shard; weigh the shard losses
                loss = deepspeed_sp_compute_loss(accelerator, model, batch, False, accelerator.parallelism_config)
            else:
                loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 >= 2 * GRAD_ACCUM:
            break
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    pc = accelerator.parallelism_config
    handler = pc.sp_handler if pc is not None and pc.sp_size > 1 else None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result = json.dumps({
        "rank": accelerator.process_index, "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes, "grad_accum": accelerator.gradient_accumulation_steps,
        "dp_shard": pc.dp_shard_size if pc else None, "sp": pc.sp_size if pc else None, "losses": losses,
        "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "sp_seq_length": handler.sp_seq_length if handler else None,
        "sp_seq_length_is_variable": handler.sp_seq_length_is_variable if handler else None,
        "sp_attn_implementation": handler.sp_attn_implementation if handler else None,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "params": len(params), "sharded_params": sum(isinstance(p, DTensor) for p in params),
        "local_numel": sum(t.numel() for t in local), "full_numel": sum(p.numel() for p in params),
        "updated": sum(not torch.equal(a.detach(), b) for a, b in zip(params, before)),
        "mixed_precision": accelerator.mixed_precision, "is_fsdp2": getattr(accelerator, "is_fsdp2", False),
    })
    with open(os.path.join(os.environ.get("TINY_OUT", "."), f"rank{rank}.json"), "w") as f:
        f.write(result)
    # Leave together and tear gloo down before the interpreter exits: a rank that exits while its peer's gloo
    # pair is still open aborted now and then ("terminate called without an active exception", SIGABRT).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
