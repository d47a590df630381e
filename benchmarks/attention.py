"""Benchmark sequence-parallel attention: time, work balance, accuracy.

For Ulysses, Ring and USP at 2 and 4 ranks it measures the forward+backward wall time of one
attention layer (the slowest rank's per iteration, median over the iterations) and compares it, as
ratios measured in the same run, with

* single-process attention on the same total work (one process, the whole sequence) using the SAME
  total number of cores as the parallel run: on CPU every rank runs one intra-op thread, so W ranks
  on C cores use min(W, C) cores, and the baseline runs with that many threads (comparing W ranks
  with a 1-thread baseline would credit the parallel run with cores the baseline was denied); on GPUs
  the baseline is one GPU, and
* DeepSpeed's ``DistributedAttention`` (Ulysses) on the same inputs with the same local kernel, when
  deepspeed is importable (run with a venv that has it; see docs/runtime_attention.md).

It also reports the per-rank kernel work of zigzag ring attention (max/min matmul FLOPs over the
attended pairs, from ``KernelWorkCounter``; target <= 1.05) and, unless ``--no-accuracy``, the
errors of every path against the fp64 reference (fp32 max-norm relative errors, and the bf16 RMS
error as a multiple of one single-device bf16 kernel call's).

CPU (gloo, one intra-op thread per rank) by default; on a machine with enough GPUs it runs one rank
per GPU with NCCL in bf16. On a CPU the ratios therefore show the cost of the sequence-parallel
machinery (all-to-all packing, ring merges, gloo over loopback) at equal compute, not scaling: a
ratio above 1.00x is overhead. Medians, not minimums: the minimum of a noisy shared machine rewards
the luckiest iteration; the printed spread (min-max over the iterations) shows the noise.

    python benchmarks/attention.py [--seq 2048 --heads 8 --head-dim 64 --iters 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed import run_ranks

#: (path, ring, ulysses): the sequence-parallel configurations measured.
CONFIGS: tuple[tuple[str, int, int], ...] = (
    ("ulysses", 1, 2),
    ("ring", 2, 1),
    ("ulysses", 1, 4),
    ("ring", 4, 1),
    ("usp", 2, 2),
)
#: Zigzag balance target from the issue: max/min per-rank kernel FLOPs.
BALANCE_TARGET = 1.05
#: Per-iteration times are the slowest rank's; across iterations we report the median (a minimum would
#: report the luckiest iteration of a shared machine, and flatter whichever side got it).
ESTIMATOR = statistics.median
#: Spawn bound per configuration (interpreter start-up included).
SPAWN_TIMEOUT_S = 900.0


def _deepspeed_attention(group):
    """DeepSpeed's Ulysses wrapper around our local kernel, or None when deepspeed is not installed."""
    try:
        import deepspeed.comm as ds_comm
        from deepspeed.sequence.layer import DistributedAttention
    except ImportError:
        return None
    import torch
    import torch.distributed as dist

    from sp_plan.runtime.attention.api import local_attention

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)

    class _Local(torch.nn.Module):
        def forward(self, q, k, v, *args, **kwargs):
            return local_attention(q, k, v, causal=True)

    # (batch, seq, heads, head_dim): scatter heads (dim 2), gather sequence (dim 1), batch first.
    attention = DistributedAttention(_Local(), group, scatter_idx=2, gather_idx=1)
    return lambda q, k, v: attention(q, k, v, 0)


def _bench_rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from sp_plan.cost_models.layout import Layout
    from sp_plan.runtime.attention.kernel import KernelWorkCounter
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import build_mesh

    device = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg["dtype"])
    ring, uly = cfg["ring"], cfg["ulysses"]
    if cfg["path"] == "single":
        sp = SequenceParallel()
    else:
        mesh = build_mesh(Layout(ring=ring, ulysses=uly), device_type=cfg["device"])
        sp = SequenceParallel.from_mesh(mesh)
    batch, seq, heads, kv_heads, head_dim = cfg["batch"], cfg["seq"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    local = seq // (ring * uly)
    gen = torch.Generator().manual_seed(1234 + rank)

    def tensor(h):
        return torch.randn(batch, local, h, head_dim, generator=gen).to(device=device, dtype=dtype)

    q, k, v, dout = tensor(heads), tensor(kv_heads), tensor(kv_heads), tensor(heads)
    runners = {"ours": lambda a, b, c: sp.attention(a, b, c, causal=True)}
    if cfg["path"] == "ulysses":
        ds = _deepspeed_attention(sp.ulysses_group)
        if ds is not None:
            runners["deepspeed"] = ds

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()

    def one(run) -> float:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sync()
        start = time.perf_counter()
        run(*leaves).backward(dout)
        sync()
        return time.perf_counter() - start

    for _ in range(cfg["warmup"]):
        for run in runners.values():
            one(run)
    times = {name: [] for name in runners}
    for _ in range(cfg["iters"]):  # interleaved, so both implementations see the same machine state
        for name, run in runners.items():
            times[name].append(one(run))
    if dist.is_initialized():  # the step takes as long as the slowest rank
        for name in times:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] = t.tolist()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with KernelWorkCounter() as work:
        sp.attention(*leaves, causal=True).backward(dout)
    agreement = None
    if "deepspeed" in runners:  # same inputs, same kernel: the outputs must agree (else the comparison is void)
        with torch.no_grad():
            ours, theirs = runners["ours"](q, k, v), runners["deepspeed"](q, k, v)
        agreement = ((ours.double() - theirs.double()).abs().max() / ours.double().abs().max()).item()
    return {"times": times, "flops": work.flops, "deepspeed_vs_ours_rel_diff": agreement}


def _accuracy_rank(rank: int, world: int, ring: int, uly: int) -> dict:
    import torch

    from tests.attention_checks import run_case, sp_context

    sp = sp_context(world, ring=ring, ulysses=uly)
    return {
        "fp32": run_case(sp, seed=3, batch=2, seq=64, heads=8, kv_heads=2, head_dim=16, dtype=torch.float32,
                         causal=True)["dist"],
        "fp32_noncausal": run_case(sp, seed=4, batch=2, seq=64, heads=8, kv_heads=2, head_dim=16,
                                   dtype=torch.float32, causal=False)["dist"],
        "bf16": run_case(sp, seed=5, batch=1, seq=512, heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                         causal=True, with_single=True),
    }


def _run(world: int, fn, *args, backend: str, threads: int = 1):
    return run_ranks(world, fn, *args, timeout=SPAWN_TIMEOUT_S, threads=threads, backend=backend)


def cores_used(world: int, cores: int) -> int:
    """Cores a run of ``world`` single-threaded ranks can use on ``cores`` cores."""
    return max(1, min(world, cores))


def _spread(times: list[float]) -> str:
    return f"{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}"


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (DeepSpeed needs >= the Ulysses degree)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every measurement this many times, alternating, and pool the iterations")
    parser.add_argument("--no-accuracy", action="store_true")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, backend = ("cuda", "nccl") if cuda else ("cpu", "gloo")
    dtype = "bfloat16" if cuda else "float32"
    gpus = torch.cuda.device_count() if cuda else 0
    base = dict(device=device, dtype=dtype, batch=args.batch, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, iters=args.iters, warmup=args.warmup)
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None

    cores = os.cpu_count() or 1
    print(f"# attention benchmark: {device} ({gpus} GPUs)" if cuda else
          f"# attention benchmark: CPU, {cores} cores, gloo, 1 thread per rank; single-process baselines with "
          "as many threads as the parallel run has cores")
    print(f"# torch {torch.__version__}; deepspeed {ds_version or 'not installed'}; dtype {dtype}; causal; "
          f"batch {args.batch}, seq {args.seq}, heads {args.heads}, kv_heads {args.kv_heads}, "
          f"head_dim {args.head_dim}; "
          f"median of {args.iters} iterations x {args.rounds} round(s) (each: the slowest rank)")
    runnable = [(path, ring, uly) for path, ring, uly in CONFIGS if not (cuda and ring * uly > gpus)]
    # One baseline per core count the parallel runs use (GPU: one GPU).
    thread_counts = sorted({1} | ({cores_used(r * u, cores) for _, r, u in runnable} if not cuda else set()))
    # Rounds: every measurement once per round, in the same order, and the iterations pooled over the
    # rounds, so slow drifts of a shared machine's load hit the baselines and the parallel runs alike.
    single_times: dict[int, list[float]] = {t: [] for t in thread_counts}
    pooled: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        for threads in thread_counts:
            single = _run(1, _bench_rank, dict(base, path="single", ring=1, ulysses=1), backend=backend,
                          threads=threads)[0]
            single_times[threads] += single["times"]["ours"]
        for path, ring, uly in runnable:
            result = _run(ring * uly, _bench_rank, dict(base, path=path, ring=ring, ulysses=uly), backend=backend)
            entry = pooled.setdefault((path, ring, uly), {"times": {}, "result": result})
            for name, values in result[0]["times"].items():
                entry["times"].setdefault(name, []).extend(values)
    baselines = {t: ESTIMATOR(v) for t, v in single_times.items()}
    rows = []
    for threads in thread_counts:
        label = "single process" if cuda else f"single process, {threads} thread{'s' if threads > 1 else ''}"
        rows.append((label, 1, "-", threads, baselines[threads], _spread(single_times[threads]), 1.0, None, None,
                     None))
    agreement: list[str] = []
    for (path, ring, uly), entry in pooled.items():
        world = ring * uly
        result, times = entry["result"], entry["times"]["ours"]
        ours = ESTIMATOR(times)
        used = 1 if cuda else cores_used(world, cores)
        ds = ESTIMATOR(entry["times"]["deepspeed"]) if "deepspeed" in entry["times"] else None
        flops = [r["flops"] for r in result]
        balance = max(flops) / min(flops) if path != "ulysses" else None
        rows.append((path, world, f"ring={ring} x ulysses={uly}", used, ours, _spread(times), ours / baselines[used],
                     ds, ours / ds if ds else None, balance))
        diffs = [r["deepspeed_vs_ours_rel_diff"] for r in result if r["deepspeed_vs_ours_rel_diff"] is not None]
        if diffs:
            agreement.append(f"{path} {world} ranks: max-norm relative difference {max(diffs):.1e}")

    print()
    cores_header = "GPUs" if cuda else "cores used"
    print(f"| path | ranks | layout | {cores_header} | fwd+bwd ms (median) | spread ms | vs single process, same cores "
          "| DeepSpeed Ulysses ms | ours / DeepSpeed | kernel FLOPs max/min |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path, world, layout, used, t, spread, ratio, ds, vs_ds, balance in rows:
        print(f"| {path} | {world} | {layout} | {used} | {t * 1e3:.1f} | {spread} | {ratio:.2f}x | "
              f"{'-' if ds is None else f'{ds * 1e3:.1f}'} | {'-' if vs_ds is None else f'{vs_ds:.2f}x'} | "
              f"{'-' if balance is None else f'{balance:.3f}'} |")
    if agreement:
        print()
    for line in agreement:
        print(f"DeepSpeed vs ours, same inputs and kernel: {line}")
    ring_balances = [r[9] for r in rows if r[9] is not None]
    if ring_balances:
        verdict = "meets" if max(ring_balances) <= BALANCE_TARGET else "MISSES"
        print(f"\nzigzag work balance: worst max/min = {max(ring_balances):.3f} ({verdict} the <= {BALANCE_TARGET} "
              "target)")

    if args.no_accuracy or cuda:
        return
    from tests.attention_checks import combine

    print("\n| path | ranks | fp32 causal max rel err (out, dq, dk, dv) | fp32 non-causal | "
          "bf16 RMS err / single-call RMS err (out, dq, dk, dv) |")
    print("|---|---|---|---|---|")
    for path, ring, uly in CONFIGS:
        per_rank = _run(ring * uly, _accuracy_rank, ring, uly, backend=backend)
        causal = combine([r["fp32"] for r in per_rank])
        noncausal = combine([r["fp32_noncausal"] for r in per_rank])
        bf16 = combine([r["bf16"]["dist"] for r in per_rank])
        bf16_single = combine([r["bf16"]["single"] for r in per_rank])
        fmt = lambda errs: ", ".join(f"{errs[n][0]:.1e}" for n in ("out", "dq", "dk", "dv"))
        ratios = ", ".join(f"{bf16[n][1] / bf16_single[n][1]:.2f}" for n in ("out", "dq", "dk", "dv"))
        print(f"| {path} | {ring * uly} | {fmt(causal)} | {fmt(noncausal)} | {ratios} |")


if __name__ == "__main__":
    main()
