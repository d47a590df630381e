"""``sp-plan validate`` measures pipelined plans through the console script (CPU gloo ranks, tiny Llama, fp32).

Every step runs through the plan's torch.distributed.pipelining schedule. Per stage (pp=2 x tp=2 as a table,
pp=2 x ulysses=2 as JSON): the P2P bytes a stage sends equal the cost model's pipeline transfers exactly (and
``micro-batches x local tokens x hidden x 4 B``, the arithmetic written out here), parameter, gradient and
optimizer-state bytes equal the memory model's stage states, the micro-batches in flight at the stage's peak equal
the 1F1B count (stage 0 holds 2, stage 1 one), the activations one micro-batch saves and those a stage holds at its
peak differ from the model only by the explained bytes (the schedule's views of the step's ids/labels, nll_loss's
scalar), and TP's collectives, Ulysses' all-to-alls and FSDP2's reduce-scatters equal the per-stage prediction. The
time prediction uses a preset topology, so no probe runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

SCRIPT = str(Path(sys.executable).parent / "sp-plan")
HIDDEN, SEQ, MICRO_BATCHES = 64, 128, 2
CONFIG = {"model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": False}
#: Token ids (int64) per local token.
INDEX_BYTES = 8
#: nll_loss saves its fp32 ``total_weight`` scalar, which no memory model counts.
NLL_SCALAR_BYTES = 4


def _validate(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([SCRIPT, "validate", "--model", str(config), "--seq-len", str(SEQ), "--dtype", "fp32",
                           "--grad-accum", str(MICRO_BATCHES), "--steps", "1", "--time-topology", "dgx-h100", *flags],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _row(table: str, label: str) -> tuple[list[str], list[str]]:
    """The predicted cells and the measured cells (worst last) of a row of the pipelined table."""
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(label))
    return lines[at][len(label):].split(), lines[at + 1].split()[1:]


@pytest.mark.timeout(300)
def test_validate_prints_a_pipelined_table_with_exact_p2p_parameter_and_tp_rows(tmp_path):
    """pp=2 x tp=2 (Megatron sequence parallelism: a stage boundary carries a TP rank's sequence shard)."""
    table = _validate(tmp_path, "--gpus", "4", "--pp", "2", "--tp", "2").stdout
    assert "plan: pp=2 x tp=2 on 4 rank(s)" in table
    stages = next(line for line in table.splitlines() if line.startswith("pipeline stage")).split()[2:]
    assert stages == ["0", "0", "1", "1"]
    predicted, measured = _row(table, "comm pipeline (P2P sends) MB/step (predicted)")
    p2p_mb = MICRO_BATCHES * SEQ // 2 * HIDDEN * 4 / 1e6
    assert predicted == measured[:4] == [f"{p2p_mb:.3f}"] * 4 and measured[4] == "exact"
    for label in ("parameters MB (predicted)", "gradients MB (predicted)", "optimizer states MB (predicted)",
                  "micro-batches in flight (predicted)", "comm tp (all collectives) MB/step (predicted)"):
        predicted, measured = _row(table, label)
        assert predicted == measured[:4] and measured[4] == "exact" and "n/a" not in predicted, label
    assert _row(table, "micro-batches in flight (predicted)")[1][:4] == ["2.00", "2.00", "1.00", "1.00"]  # 1F1B
    assert "note: pipeline P2P:" in table and "Traceback" not in table


@pytest.mark.timeout(300)
def test_validate_pp2_x_ulysses2_json_matches_the_cost_model_per_stage(tmp_path):
    # ZeRO-3 over the Ulysses ranks: under the pipeline a stage keeps its parameters gathered through the step
    # (as torchtitan and the cost model), so the all-gather bytes are exact (resharding after every forward
    # measured 2.4-3x the model's)
    report = json.loads(_validate(tmp_path, "--gpus", "4", "--pp", "2", "--ulysses", "2", "--zero", "3",
                                  "--json").stdout)
    stages = report["stages"]
    assert [s["stage"] for s in stages] == [0, 1] and len(report["ranks"]) == 4
    local_tokens = SEQ // 2
    views = (MICRO_BATCHES - 1) * local_tokens * INDEX_BYTES  # the schedule's micro-batch views of the step's ids
    for rank in report["ranks"]:
        measured = rank["stage"]
        stage = stages[measured["stage"]]
        assert measured["stage"] == rank["rank"] // 2  # pp is the outer mesh dim
        p2p = rank["comm_bytes"]["pipeline (P2P sends)"]
        assert p2p == stage["comm_bytes"]["pipeline (P2P sends)"] == MICRO_BATCHES * local_tokens * HIDDEN * 4 > 0
        for row in ("all_to_all", "reduce_scatter", "all_reduce (loss)"):
            assert rank["comm_bytes"][row] == stage["comm_bytes"][row] > 0, row
        assert rank["comm_bytes"]["all_gather"] == stage["comm_bytes"]["all_gather"] > 0
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "in_flight"):
            assert measured[key] == stage[key] > 0, key
        unexplained = NLL_SCALAR_BYTES if stage["last"] else 0
        assert measured["activation_bytes"] - stage["activation_bytes"] == views + unexplained
        assert rank["activation_bytes"] == measured["activation_bytes"]
        # Held at the peak: stage 0's two micro-batches share the step's ids storage (counted once, exactly the
        # model's two micro-batches' ids); the last stage holds one micro-batch.
        assert measured["held_activation_bytes"] - stage["held_activation_bytes"] == (
            views + NLL_SCALAR_BYTES if stage["last"] else 0)
        assert len(rank["step_seconds"]) >= 2 and all(s > 0 for s in rank["step_seconds"])
    assert [s["in_flight"] for s in stages] == [2.0, 1.0]
    from sp_plan.runtime.validate import render

    assert "comm pipeline (P2P sends)" in render(report)
