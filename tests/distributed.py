"""Multi-rank test harness: start CPU ranks with gloo, run a function on each, collect the results.

``run_ranks(world, fn, *args)`` starts ``world`` fresh processes (forked from a clean forkserver that
has imported torch once, so safe after torch has started threads in the parent), initialises a gloo
process group on a free loopback port, calls ``fn(rank, world, *args)`` on every rank and returns
the per-rank results in rank order. If any rank raises, the error names the failing rank(s) and
carries their tracebacks; if the ranks do not finish within ``timeout`` seconds (a deadlocked
collective, for instance) they are terminated and the error says which ranks were still running.
``fn`` and the results must be picklable (module-level function, plain data or CPU tensors).

Ranks run with one intra-op thread each: the machines that run the suite have 2 cores, and 4 ranks
fighting over them with default thread pools is slower and noisier.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

#: Wall-clock bound for one spawn (start-up of the interpreters included).
DEFAULT_TIMEOUT_S = 120.0
#: How long a finished rank may take to exit before it is terminated.
JOIN_TIMEOUT_S = 5.0
#: Bound on gloo's own collective timeout inside the ranks, so a mismatched collective fails, not hangs.
COLLECTIVE_TIMEOUT_S = 60.0


#: Imported once by the forkserver, so that no rank pays for them again: torch and its distributed and
#: sharding packages, the runtime modules every rank imports, and the transformers modelling modules the HF
#: tests' ranks build (Llama, DeepSeek-V3, Qwen3-MoE: seconds each to import on these 2 cores). A module that
#: is not installed is skipped by the forkserver.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "sp_plan.runtime.parallelize", "sp_plan.runtime.trainer", "transformers.models.llama.modeling_llama",
           "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.qwen3_moe.modeling_qwen3_moe"]


def _context() -> mp.context.BaseContext:
    """A forkserver that has imported torch once: each rank is then a cheap fork of a clean process.

    Plain fork would copy a parent whose torch may already run threads (unsafe); plain spawn would
    import torch again in every rank of every test (seconds each on 2 cores).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, threads: int, backend: str, fn: Callable, args: tuple, results: mp.Queue
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        value = fn(rank, world, *args)
        # Rank 0 hosts the rendezvous store: nobody may tear down while a peer still needs it.
        dist.barrier()
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def error_of(fn: Callable[[], Any]) -> str | None:
    """What ``fn()`` raised, as ``"Type: message"`` (a rank's result for the parent to assert on), or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    threads: int = 1,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; return the results by rank.

    ``backend="nccl"`` (benchmarks on a multi-GPU machine) puts rank i on GPU i.
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world, port, threads, backend, fn, args, results), daemon=True)
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(outcomes))
                raise TimeoutError(
                    f"ranks {missing} of {world} did not finish within {timeout:.0f} s (deadlock or too slow); "
                    + _failures_text(outcomes)
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outcomes]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} of {world} died without reporting (exit codes "
                        f"{[procs[i].exitcode for i in dead]}); " + _failures_text(outcomes)
                    ) from None
                continue
            outcomes[rank] = (ok, value)
            if not ok:  # one failure: give the others a moment to report theirs, then stop
                _drain(results, outcomes, world, grace=5.0)
                break
    finally:
        clean = len(outcomes) == world and all(ok for ok, _ in outcomes.values())
        for proc in procs:
            if clean:  # every rank passed the final barrier: they are only tearing down
                proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=JOIN_TIMEOUT_S)
    failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failed:
        raise AssertionError(_failures_text(outcomes))
    return [outcomes[r][1] for r in range(world)]


def _drain(results: mp.Queue, outcomes: dict, world: int, grace: float) -> None:
    end = time.monotonic() + grace
    while len(outcomes) < world and time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        outcomes[rank] = (ok, value)


def _failures_text(outcomes: dict) -> str:
    failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if not failed:
        return "no rank reported an error"
    return "\n".join(f"--- rank {rank} failed ---\n{text}" for rank, text in sorted(failed.items()))
