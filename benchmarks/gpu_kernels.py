"""Kernel-level measurements on this machine's accelerator, in the form the kernel model is pinned from.

Issue 21 keeps the kernel model apart from the stacks: its GEMM and attention efficiencies are fitted only to
kernel-level figures (``cost_models/data/calibration/kernels.yaml``). Several registered misses
(``cost_models/data/calibration/misses.yaml``) wait on such figures that no public source prints with its GPU
variant and library versions: cuBLAS FP8 GEMMs through ``torch._scaled_mm`` on an H100 SXM (tensorwise scaling,
with and without fast accumulation, as torchao's Float8 and Transformer Engine run their forward and backward
GEMMs), cuDNN's and FlashAttention's attention by length on the board at hand. One run of this script on a
lent GPU measures them:

- GEMMs: bf16 ``torch.mm`` and FP8 (e4m3) ``torch._scaled_mm`` with tensorwise scales, ``use_fast_accum`` off
  and on, at square shapes and Llama 3 8B / 70B training shapes; random inputs (all-zero inputs draw less power
  and run faster, which inflated early published FP8 figures);
- attention: ``scaled_dot_product_attention`` forward and backward on each SDPA backend that runs here (flash =
  PyTorch's FlashAttention-2, cuDNN, memory-efficient), causal and full, head_dim 128, by sequence length, in
  the FlashAttention papers' setup (batch x length = 16K tokens, 16 heads of 128) and FLOP convention, the
  backward kernel timed alone on a kept graph;
- the environment: device name, torch / CUDA / cuDNN versions, the board's power limit and the SM clock
  sampled while the GEMMs run (``nvidia-smi``), so the figures name their variant.

It prints each figure beside the shipped kernel model's prediction for ``--gpu`` (the preset the device name
matches unless given) and writes ``--out`` (YAML): sources and entries in ``kernels.yaml``'s own format, to be
reviewed and merged there (then ``python benchmarks/accuracy.py --fit --write``); the test suite reads such a
file back through the kernel fit's loader. Timings: CUDA events around ``--iters`` calls after warm-up, the
median of ``--repeats``; on a CPU the same code runs at small sizes (``--quick``), for the script's own checks.

    python benchmarks/gpu_kernels.py [--gpu h100-80gb] [--quick] [--out measured-kernels.yaml]
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from sp_plan.cost_models.gpu_spec import get_gpu_preset  # noqa: E402
from sp_plan.cost_models.kernels import kernel_model  # noqa: E402
from sp_plan.planner.fitting.kernel_fit import attention_tflops, fa_paper_flops, gemm_tflops  # noqa: E402

#: The FlashAttention papers' benchmark setup (kernels.yaml's fa3-paper source): batch x length = 16K tokens,
#: hidden 2048 (16 heads of 128).
TOKENS, HIDDEN, HEAD_DIM = 16384, 2048, 128
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
SQUARE = (2048, 4096, 8192)
#: (m, n, k) of one 8K-token micro-batch through Llama 3 8B and 70B (TP 8) linears: QKV, out projection, gate+up,
#: down; the backward GEMMs have the same three dimensions in other orders.
TRAINING_SHAPES = ((8192, 6144, 4096), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
                   (8192, 1280, 8192), (8192, 8192, 1024), (8192, 7168, 8192), (8192, 8192, 3584))
#: SDPA backend -> the kernel model's attention family it measures (the memory-efficient backend has no family of
#: its own in the kernel model, and no priced stack runs it for training).
BACKENDS = {"FLASH_ATTENTION": "fa2", "CUDNN_ATTENTION": "cudnn"}
FP8 = torch.float8_e4m3fn


def _rate(flops: float, seconds: float) -> float:
    """TFLOP/s to four significant digits (a CPU's rates are far below 1)."""
    return float(f"{flops / max(seconds, 1e-12) / 1e12:.4g}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], Any], device: torch.device, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``iters`` back-to-back calls, after warm-up."""
    for _ in range(2):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


# ----- the environment -------------------------------------------------------------------------------------


def _nvidia_smi(query: str) -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else None


class ClockSampler:
    """SM clock (MHz) and board power (W) polled from ``nvidia-smi`` while a load runs (empty without it)."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.period_s, self.samples = period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            row = _nvidia_smi("clocks.sm,power.draw")
            if row is None:
                return
            try:
                self.samples.append((float(row[0]), float(row[1])))
            except ValueError:
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> "ClockSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def environment(device: torch.device) -> dict[str, Any]:
    """What the figures ran on, for the source's ``software`` and ``where``."""
    env: dict[str, Any] = {"torch": torch.__version__, "device": device.type,
                           "dtype": "bf16" if device.type == "cuda" else "fp32"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(name=props.name, memory_bytes=props.total_memory, sms=props.multi_processor_count,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        row = _nvidia_smi("power.limit,clocks.max.sm,driver_version")
        if row is not None:
            env.update(power_limit_w=row[0], max_sm_clock_mhz=row[1], driver=row[2])
    else:
        import platform

        env.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def guess_preset(env: dict[str, Any]) -> str | None:
    """The GPU preset the device's name matches (the probe's rule), or None (always on a CPU)."""
    if env["device"] != "cuda":
        return None
    from sp_plan.runtime.probe.build import match_gpu_preset

    return match_gpu_preset(env["name"], int(env["memory_bytes"]))


# ----- GEMMs -------------------------------------------------------------------------------------------------


def _fp8_operands(m: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-major A (m, k) and column-major B (k, n) in e4m3 with a tensorwise scale, from random data."""
    a = torch.randn(m, k, device=device)
    b = torch.randn(n, k, device=device)
    amax = max(a.abs().max().item(), b.abs().max().item())
    scale = torch.tensor(torch.finfo(FP8).max / amax, device=device)
    return (a * scale).to(FP8), (b * scale).to(FP8).t(), (1.0 / scale).float()


def measure_gemms(shapes: list[tuple[int, int, int]], device: torch.device, iters: int, repeats: int
                  ) -> dict[str, list[list[float]]]:
    """TFLOP/s (2mnk) per shape: ``bf16``, ``fp8`` (precise accumulation) and ``fp8_fast_accum``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, list[list[float]]] = {"bf16": [], "fp8": [], "fp8_fast_accum": []}
    for m, n, k in shapes:
        flops = 2.0 * m * n * k
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        out["bf16"].append([m, n, k, _rate(flops, seconds_per_call(lambda: a @ b, device, iters, repeats))])
        del a, b
        try:
            a8, b8, inv = _fp8_operands(m, n, k, device)
            for key, fast in (("fp8", False), ("fp8_fast_accum", True)):
                call = lambda fast=fast: torch._scaled_mm(a8, b8, scale_a=inv, scale_b=inv, out_dtype=torch.bfloat16,
                                                          use_fast_accum=fast)
                out[key].append([m, n, k, _rate(flops, seconds_per_call(call, device, iters, repeats))])
        except (RuntimeError, NotImplementedError) as exc:  # no FP8 tensor cores (A100) or no CPU kernel
            print(f"  fp8 {m}x{n}x{k}: not measured ({str(exc).splitlines()[0][:120]})")
    return {k: v for k, v in out.items() if v}


# ----- attention ---------------------------------------------------------------------------------------------


def measure_attention(seq_lens: tuple[int, ...], tokens: int, device: torch.device, iters: int, repeats: int
                      ) -> list[dict[str, Any]]:
    """``kernels.yaml`` attention entries (kernel, pass, causal -> TFLOP/s by length) for every SDPA backend
    that runs here; the backward is timed as forward + backward less the forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads = HIDDEN // HEAD_DIM
    entries: list[dict[str, Any]] = []
    for backend, family in BACKENDS.items():
        for causal in (True, False):
            fwd_by_len: dict[int, float] = {}
            bwd_by_len: dict[int, float] = {}
            for seq in seq_lens:
                batch = max(1, tokens // seq)
                q, k, v = (torch.randn(batch, heads, seq, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
                           for _ in range(3))
                grad = torch.randn(batch, heads, seq, HEAD_DIM, device=device, dtype=dtype)

                def forward():
                    with sdpa_kernel([getattr(SDPBackend, backend)]):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                try:
                    with torch.no_grad():
                        t_fwd = seconds_per_call(forward, device, iters, repeats)
                    out = forward()  # one graph, its backward kernel timed alone (the graph is kept)
                    t_bwd = seconds_per_call(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                                             device, iters, repeats)
                except RuntimeError as exc:  # the backend does not run this shape or device
                    print(f"  {backend} {'causal' if causal else 'full'} {seq}: not measured "
                          f"({str(exc).splitlines()[0][:100]})")
                    break
                fwd_by_len[seq] = _rate(fa_paper_flops(seq, batch * heads, HEAD_DIM, causal, False), t_fwd)
                bwd_by_len[seq] = _rate(fa_paper_flops(seq, batch * heads, HEAD_DIM, causal, True), t_bwd)
            for pass_, values in (("forward", fwd_by_len), ("backward", bwd_by_len)):
                if values:
                    entries.append({"kernel": family, "pass": pass_, "causal": causal, "head_dim": HEAD_DIM,
                                    "tflops_by_seqlen": values})
    return entries


# ----- output ------------------------------------------------------------------------------------------------


def kernel_data(name: str, gpu: str, env: dict[str, Any], clocks: list[tuple[float, float]],
                gemms: dict[str, list[list[float]]], attention: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The measurements as ``kernels.yaml`` sources and entries (one source per FLOP convention and GEMM
    accumulation mode, so every figure id stays unique)."""
    when = datetime.date.today().isoformat()
    software = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "cudnn", "driver") if env.get(k) is not None)
    clock = ""
    if clocks:
        sm = sorted(c for c, _ in clocks)
        clock = (f"; SM clock while the GEMMs ran: median {statistics.median(sm):.0f} MHz (min {sm[0]:.0f}, "
                 f"board max {env.get('max_sm_clock_mhz', '?')}), power limit {env.get('power_limit_w', '?')} W")
    where = f"benchmarks/gpu_kernels.py on {env['name']} ({when}){clock}"
    sources: dict[str, Any] = {}
    out: dict[str, Any] = {"sources": sources, "attention": [], "gemm": []}
    if attention:
        sources[f"{name}-attention"] = {"where": where, "flops": "fa_paper", "software": software,
                                        "setup": f"SDPA backends, batch x seqlen = {tokens} tokens, {HIDDEN // HEAD_DIM} "
                                                 f"heads of {HEAD_DIM}, random inputs; the backward timed alone on a "
                                                 "kept graph", "tokens": tokens, "hidden": HIDDEN}
        out["attention"] = [{"source": f"{name}-attention", "gpu": gpu, "confidence": "exact", **e} for e in attention]
    notes = {"bf16": f"torch.mm, {env['dtype']} in and out",
             "fp8": "torch._scaled_mm e4m3 x e4m3 -> bf16, tensorwise scales, use_fast_accum=False (the backward "
                    "GEMMs of torchao Float8 and of Transformer Engine)",
             "fp8_fast_accum": "torch._scaled_mm e4m3 x e4m3 -> bf16, tensorwise scales, use_fast_accum=True (their "
                               "forward GEMMs)"}
    for key, shapes in gemms.items():
        source = f"{name}-gemm" + {"bf16": "", "fp8": "-fp8", "fp8_fast_accum": "-fp8-fast-accum"}[key]
        sources[source] = {"where": where, "flops": "gemm_2mnk", "software": software,
                           "note": "random inputs; " + notes[key]}
        entry = {"source": source, "gpu": gpu, "confidence": "exact", "shapes": shapes}
        if key != "bf16":
            entry["dtype"] = "fp8"
        out["gemm"].append(entry)
    return out


def compare(data: dict[str, Any], gpu: str) -> list[str]:
    """Each measured figure beside the shipped kernel model's prediction for ``gpu``."""
    model, spec = kernel_model(gpu), get_gpu_preset(gpu)
    rows = [f"{'figure':58} {'measured':>10} {'model':>10} {'model/measured':>15}"]
    for e in data["gemm"]:
        fp8 = e.get("dtype") == "fp8"
        for m, n, k, measured in e["shapes"]:
            predicted = gemm_tflops(m, n, k, fp8)(model, spec)
            rows.append(f"{e['source'] + f' {m}x{n}x{k}':58} {measured:10.4g} {predicted:10.4g} "
                        f"{predicted / measured:15.3g}")
    for e in data["attention"]:
        src = data["sources"][e["source"]]
        for seq, measured in e["tflops_by_seqlen"].items():
            predicted = attention_tflops(e["kernel"], e["pass"], e["causal"], e["head_dim"], seq, src["tokens"],
                                         src["hidden"])(model, spec)
            label = f"{e['kernel']} {e['pass']} {'causal' if e['causal'] else 'full'} {seq}"
            rows.append(f"{label:58} {measured:10.4g} {predicted:10.4g} {predicted / measured:15.3g}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", help="the GPU preset these figures ran on (default: the one the device name matches)")
    parser.add_argument("--name", default="measured", help="source name prefix in the output (default: measured)")
    parser.add_argument("--quick", action="store_true", help="small shapes and few iterations (CPU checks)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the kernels.yaml-format measurements here")
    args = parser.parse_args(argv)

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    env = environment(device)
    gpu = args.gpu or guess_preset(env)
    if gpu is None:
        parser.error(f"device {env['name']!r} matches no GPU preset: name one with --gpu" if device.type == "cuda" else
                     "no GPU here: a CPU run only checks the script; name the preset to compare with, --gpu PRESET, "
                     "and do not merge its figures")
    get_gpu_preset(gpu)  # an unknown --gpu fails here, with the closest names
    quick = args.quick or device.type == "cpu"
    iters = args.iters or (2 if quick else 20)
    repeats = 2 if quick else args.repeats
    shapes = [(64, 64, 64), (128, 64, 96)] if quick else [*((s, s, s) for s in SQUARE), *TRAINING_SHAPES]
    seq_lens, tokens = ((64, 128), 128) if quick else (SEQ_LENS, TOKENS)
    print(f"device: {env['name']} ({gpu}); torch {env['torch']}"
          + (f", CUDA {env['cuda']}, cuDNN {env['cudnn']}" if device.type == "cuda" else ""))
    with ClockSampler() as sampler:
        gemms = measure_gemms(shapes, device, iters, repeats)
    attention = measure_attention(seq_lens, tokens, device, iters, repeats)
    data = kernel_data(args.name, gpu, env, sampler.samples, gemms, attention, tokens)
    print("\n".join(compare(data, gpu)))
    if args.out is not None:
        args.out.write_text(yaml.safe_dump(data, sort_keys=False))
        print(f"wrote {args.out}: review, then merge its sources and entries into "
              "cost_models/data/calibration/kernels.yaml and run python benchmarks/accuracy.py --fit --write")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
