"""Bad input a first-time user types, found by driving the ``sp-plan`` console script by hand: each case was a
silent wrong answer or a misleading message. Every one must now be one line on stderr, naming what is wrong and
what fixes it, with the documented exit code (2: bad input), and no traceback."""

from __future__ import annotations

import json

import pytest

from sp_plan.cli.main import main

SMALL = ["--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8"]


def refused(args: list[str], capsys) -> str:
    """The one-line error of a refused command (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command, flags, named", [
    ("estimate", ["--virtual-stages", "2"], "--virtual-stages 2"),
    ("estimate", ["--schedule", "zero_bubble"], "--schedule zero_bubble"),
    ("plan", ["--pp", "1", "--virtual-stages", "2"], "--virtual-stages 2"),
    ("plan", ["--pp", "1", "--schedule", "zero_bubble"], "--schedule zero_bubble"),
])
def test_a_pipeline_schedule_without_pipeline_stages_is_refused_not_ignored(command, flags, named, capsys):
    """Was: exit 0 with a plain pp=1 answer, the asked-for schedule or chunking silently dropped."""
    err = refused([command, *SMALL, *flags, *(["--top", "1"] if command == "plan" else [])], capsys)
    assert named in err and "pp=1" in err and "--pp N" in err


@pytest.mark.parametrize("pins, named", [(["--ulysses", "16"], "ulysses=16"), (["--tp", "3"], "tp=3")])
def test_capacity_pins_that_cannot_split_the_gpus_are_bad_input_not_no_fit(pins, named, capsys):
    """Was: exit 1, "does not fit on 8 x h100-80gb even at 1024 tokens; use more GPUs" for a typo'd degree."""
    err = refused(["capacity", "--model", "llama3-8b", "--gpus", "8", *pins], capsys)
    assert named in err and "8 GPUs" in err and "use more GPUs" not in err


def test_a_sweep_point_the_pins_cannot_split_says_why_not_does_not_fit(capsys):
    """Was: "does not fit (closest is short by 0.0 GB)" at 4 GPUs for --ulysses 8, a memory miss that never was."""
    args = ["capacity", "--model", "llama3-8b", "--seq-len", "32K", "--sweep", "gpus=4,8", "--ulysses", "8"]
    main(args)
    out = capsys.readouterr().out
    assert "does not fit" not in out and "short by" not in out
    row = next(line for line in out.splitlines() if line.strip().startswith("4 "))
    assert "no plan [1]" in row
    assert any(line.startswith("[1] 32K on 4 GPUs:") and "ulysses=8" in line for line in out.splitlines())
    main([*args, "--json"])
    points = json.loads(capsys.readouterr().out)["sweep"]
    assert "ulysses=8" in points[0]["refused"] and points[0]["plan"] is None
    assert "refused" not in points[1] and points[1]["plan"] is not None


def test_capacity_longest_sequence_takes_a_document_length(capsys):
    """Was: exit 2, "document_length=4096 exceeds seq_len=1024", a length the user never typed (the search's
    first probe)."""
    steps = []
    for documents in (["--document-length", "4K"], []):
        main(["capacity", "--model", "llama3-8b", "--gpus", "8", "--json", *documents])
        answer = json.loads(capsys.readouterr().out)
        assert answer["max_seq_len"] > 4096
        steps.append(answer["plan"]["time"]["step_s"])
    assert steps[0] < steps[1] / 2  # 4K documents attend within themselves: far cheaper than one long one


@pytest.mark.parametrize("command, args", [
    ("estimate", SMALL),
    ("plan", [*SMALL, "--top", "1"]),
    ("capacity", ["--model", "llama3-8b", "--seq-len", "32K", "--sweep", "gpus=8"]),
])
@pytest.mark.parametrize("name", ["memory.jpg", "memory.txt", "-"])
def test_a_plot_file_sp_plan_cannot_draw_is_refused_before_the_work(command, args, name, tmp_path, capsys,
                                                                    monkeypatch):
    """Was: PNG bytes written under a .jpg/.txt name, and ``--plot -`` a file literally named '-' (every other
    option's '-' is standard output), all with exit 0."""
    monkeypatch.chdir(tmp_path)
    err = refused([command, *args, "--plot", name], capsys)
    assert ".png, .svg or .pdf" in err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("line", ["  attention_kernel: fa33\n", "  attention_kernel_by_gpu: {b200: cudnnn}\n"])
def test_a_stack_file_naming_an_unknown_attention_kernel_is_refused(line, tmp_path, capsys):
    """Was: exit 0, the typo silently priced as FlashAttention-2 (the fallback for a GPU without the kernel)."""
    stack = tmp_path / "my-stack.yaml"
    stack.write_text(f"name: my-stack\ntime:\n{line}")
    err = refused(["estimate", *SMALL, "--stack", stack], capsys)
    assert "my-stack.yaml" in err and "attention_kernel" in err and "fa2, fa3, cudnn, sdpa" in err


@pytest.fixture(scope="module")
def prefill_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / "prefill.yaml"
    main(["plan", *SMALL, "--mode", "prefill", "--top", "1", "--out", str(path)])
    assert path.exists()
    return path


@pytest.mark.parametrize("target", ["accelerate", "deepspeed", "torchrun", "megatron"])
def test_a_prefill_plan_is_not_exported_as_a_training_launch(target, prefill_plan, capsys):
    """Was: exit 0 for accelerate, deepspeed and torchrun: training configs (TrainingArguments with gradient
    checkpointing, ZeRO settings) or a `sp-plan train` launch (which refuses prefill plans) from a plan priced for
    a forward pass; megatron's refusal pointed to torchrun."""
    capsys.readouterr()
    err = refused(["export", prefill_plan, "--to", target], capsys)
    assert "prefill" in err and "--mode train" in err and "--to torchrun" not in err


def test_a_config_json_without_model_type_says_what_to_add_and_names_its_file(tmp_path, capsys):
    """Was: "model_type '' is not supported", headed by the folder's name ("configs: ...") for any file in it."""
    folder = tmp_path / "configs"
    folder.mkdir()
    path = folder / "my-llama.json"
    path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32, '
                    '"num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256}')
    err = refused(["estimate", "--model", path, "--seq-len", "32K", "--gpus", "8"], capsys)
    assert err.startswith("error: my-llama: config.json has no model_type (architectures: LlamaForCausalLM)"), err
    assert "llama" in err.split("one of")[1]


def test_a_hub_id_without_network_is_one_line_at_once(tmp_path, monkeypatch, capfd):
    """Was: ten lines of the hub client's retry warnings over about 25 s before the one line that explains."""
    import socket
    import time

    pytest.importorskip("huggingface_hub")

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--model", "some-org/some-model", "--seq-len", "32K", "--gpus", "8"])
    err = capfd.readouterr().err
    assert exc.value.code == 2 and time.monotonic() - started < 5
    assert err.count("\n") == 1 and "not in the Hugging Face cache and the hub cannot be reached" in err, err


RUNS_HEADER = "model,seq_len,gpus,ulysses,topology,step_s\n"


@pytest.mark.parametrize("step_s", ["0.0001", "1e6"])
def test_calibrate_refuses_a_measurement_no_calibration_can_explain(step_s, tmp_path, capsys):
    """Was: exit 0 and "use it": every efficiency pinned at its bound (100% of peak for 0.1 ms), the fit still
    off by 542,709% (or 100%) on its own run, and the calibration file written."""
    runs = tmp_path / "runs.csv"
    runs.write_text(RUNS_HEADER + f"llama3-8b,32768,8,8,dgx-h100,{step_s}\n")
    err = refused(["calibrate", runs, "--out", tmp_path / "cal.yaml"], capsys)
    assert "runs.csv:2" in err and "x off the uncalibrated prediction" in err and "unit" in err
    assert not (tmp_path / "cal.yaml").exists()


def test_calibrate_refuses_checking_on_the_runs_it_fits(tmp_path, capsys, monkeypatch):
    """Was: the same file fitted on and reported again as "(held out)", with held-out errors of 0.0%."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs.csv").write_text(RUNS_HEADER + "llama3-8b,32768,8,8,dgx-h100,2.5\n")
    err = refused(["calibrate", "runs.csv", "--check", "./runs.csv", "--out", "cal.yaml"], capsys)
    assert "--check" in err and "runs.csv" in err and "separate files" in err
    assert not (tmp_path / "cal.yaml").exists()


def test_a_gpu_contradicting_the_topology_is_refused_not_ignored(capsys):
    """Was: exit 0, the plan made for the topology's H100s although --gpu a100-40gb was typed."""
    err = refused(["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--gpu", "a100-40gb",
                   "--topology", "dgx-h100"], capsys)
    assert "--gpu a100-40gb" in err and "--topology dgx-h100" in err and "h100-80gb" in err
    main(["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--gpu", "h100-sxm", "--topology",
          "dgx-h100", "--json"])  # an alias of the topology's own GPU agrees with it
    assert '"fits"' in capsys.readouterr().out


def test_a_gpu_typo_next_to_a_topology_of_an_unshipped_gpu_is_refused(tmp_path, capsys):
    """Was: exit 0 with --gpu h100-80gbb silently ignored: neither it nor the topology's own GPU (described inline)
    is shipped, so the two unknown names compared equal."""
    import yaml

    from sp_plan.cost_models.data import load

    spec = {**load("topologies", "dgx-h100"), "name": "my-cluster",
            "gpu": {"name": "my-accel", "memory_bytes": 80 << 30, "peak_flops": {"bf16": 9.0e14, "fp32": 6.0e13},
                    "memory_bandwidth": 3.0e12}}
    topology = tmp_path / "my-cluster.yaml"
    topology.write_text(yaml.safe_dump(spec))
    base = ["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--topology", str(topology)]
    err = refused([*base, "--gpu", "h100-80gbb"], capsys)
    assert "unknown GPU 'h100-80gbb'" in err and "did you mean h100-80gb" in err and "my-accel" in err
    main([*base, "--gpu", "My-Accel", "--json"])  # the topology's own GPU, named as it describes it
    assert '"fits"' in capsys.readouterr().out


def test_gpus_per_node_help_shows_the_limit_the_topology_enforces(capsys):
    """Was: --help said 1<=x<=1024 while 300 was refused as 'GPUs per node must be 1..256'."""
    main(["estimate", "--help"])
    assert "[1<=x<=256]" in capsys.readouterr().out


TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512}


@pytest.mark.parametrize("plan_args, message", [
    (["--gpus", "8"], "plan needs 8 ranks"),                              # one process started for 8
    (["--gpus", "1", "--mode", "prefill"], "prefill plans are for inference engines"),
])
def test_train_refuses_a_plan_it_cannot_run_before_building_the_model(plan_args, message, tmp_path, capsys,
                                                                      monkeypatch):
    """Was: the whole unsharded model built first (for an 8-GPU llama3-8b plan on a CPU box: 24 GB, and the
    kernel's OOM kill instead of the reason)."""
    pytest.importorskip("torch")
    from sp_plan.runtime import train_run

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    plan = tmp_path / "plan.yaml"
    main(["plan", "--model", config, "--seq-len", "256", "--top", "1", "--out", plan, *plan_args])
    capsys.readouterr()

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the plan was checked")

    monkeypatch.setattr(train_run, "build_model", no_model)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = refused(["train", "--plan", plan, "--steps", "1"], capsys)
    assert message in err


@pytest.mark.parametrize("flags, least", [
    (["--global-batch-tokens", "1K"], "one sequence of --seq-len 32,768 tokens"),
    (["--global-batch-tokens", "32K", "--micro-batch", "4"], "--micro-batch 4 x --seq-len 32,768 = 131,072 tokens"),
])
def test_a_typed_global_batch_below_one_micro_batch_is_refused(flags, least, capsys):
    """Was: exit 0 with "global batch 1 x 32K tokens" in the headline, while the plan trained 2 (or 4) sequences
    per step: the batch is rounded up to whole micro-batches per data-parallel rank without a word."""
    err = refused(["plan", *SMALL, "--top", "1", *flags], capsys)
    assert least in err and "--global-batch-tokens" in err


@pytest.mark.parametrize("flags", [["--virtual-stages", "2"], ["--schedule", "zero_bubble"]])
def test_validate_refuses_a_pipeline_schedule_without_stages_before_launching(flags, tmp_path, capsys, monkeypatch):
    """Was: two ranks launched for a plain pp=1 run, the asked-for schedule silently dropped."""
    from sp_plan.cli.commands import validate

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(validate, "_launch", no_launch)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    err = refused(["validate", "--model", config, "--seq-len", "256", "--gpus", "2", "--ulysses", "2", *flags], capsys)
    assert "pp=1" in err and "--pp N" in err


def test_train_refuses_a_plan_whose_model_this_host_cannot_build(tmp_path, capsys, monkeypatch):
    """Was: `sp-plan train --plan` of a 1-GPU llama3-8b plan on a CPU box built the 32 GB fp32 model and was
    OOM-killed (a bare SIGKILL) on a 24 GB machine. Here the host's RAM is made smaller than a tiny model."""
    pytest.importorskip("torch")
    import torch

    from sp_plan.runtime import train_run

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    plan = tmp_path / "plan.yaml"
    main(["plan", "--model", config, "--seq-len", "256", "--gpus", "1", "--top", "1", "--out", plan])
    capsys.readouterr()

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the host's memory was checked")

    monkeypatch.setattr(train_run, "build_model", no_model)
    monkeypatch.setattr(train_run, "available_host_bytes", lambda: 1000, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cuda, advice in ((False, "train this plan on GPUs"), (True, "fewer ranks per host")):
        # GPU ranks build the model in host memory too before sharding it (was: checked on CPU ranks only)
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=cuda: c)
        err = refused(["train", "--plan", plan, "--steps", "1"], capsys)
        assert "host RAM is available" in err and "GB in fp32" in err and advice in err


def test_fewer_gpus_than_the_gpus_per_node_asked_for_says_so(capsys):
    """Was: "8 GPUs do not fill whole nodes of 16: ... or set GPUs per node", although they were set."""
    err = refused(["topo", "show", "dgx-h100", "--gpus-per-node", "16"], capsys)
    assert "fewer than the 16 GPUs per node" in err and "8 GPUs per node for one partial node" in err


@pytest.mark.parametrize("command, flags, named", [
    ("estimate", ["--ulysses", "8", "--offload-optimizer"], "--offload-optimizer"),
    ("estimate", ["--ulysses", "8", "--checkpointing", "full", "--tiled-loss"], "--checkpointing, --tiled-loss"),
    ("plan", ["--optimizer", "adamw_bf16", "--top", "1"], "--optimizer"),
    ("capacity", ["--ulysses", "8", "--offload-checkpoints"], "--offload-checkpoints"),
])
def test_training_only_flags_under_prefill_are_refused_not_ignored(command, flags, named, capsys):
    """Was: exit 0 with the same figures as without them (a prefill has no backward, gradients or optimizer)."""
    args = ["--model", "llama3-8b", "--gpus", "8", "--mode", "prefill", *flags]
    if command != "capacity":
        args[2:2] = ["--seq-len", "32K"]
    err = refused([command, *args], capsys)
    assert err.startswith(f"error: {named}: training only") and "--mode train" in err


def test_prefill_keeps_the_options_it_has(capsys):
    main(["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--mode", "prefill",
          "--zero", "3", "--tiled-mlp", "--json"])
    assert json.loads(capsys.readouterr().out)["time"]["step_s"] > 0


def test_calibrate_on_fewer_runs_than_parameters_says_so(tmp_path, capsys):
    """Was: 'fitted 9 parameter(s) on 1 measurement(s)' with no word on what one run can and cannot pin."""
    runs = tmp_path / "runs.csv"
    runs.write_text(RUNS_HEADER + "llama3-8b,32768,8,8,dgx-h100,2.5\n")
    main(["calibrate", str(runs), "--out", str(tmp_path / "cal.yaml")])
    out = capsys.readouterr().out
    assert "on 1 measurement(s)" in out and "cannot tell" in out and "--check" in out
    assert (tmp_path / "cal.yaml").exists()
