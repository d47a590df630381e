"""The first prediction a CPU user sees: ``sp-plan validate`` on CPU ranks, with no calibration, predicts the
step time it then measures (issue 21 item 7).

The 25% comparison of three layouts lives in ``benchmarks/cpu_prediction.py`` (issue 35 item 9): a wall-time
comparison fails whenever other processes share the cores, and one failing CI run lands nothing. The suite
keeps the guard against the error that comparison was written for (60x: attention priced with bf16
efficiencies at the fp32 rate, ranks timed alone): the two-rank Ulysses layout, whose ranks own the cores,
within a factor of 2, retried up to twice on a miss. Under any load short of other jobs taking most of the
machine for minutes, a correct model passes; the 60x error fails every attempt.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cpu_prediction", ROOT / "benchmarks" / "cpu_prediction.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

ATTEMPTS = 3


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_cpu_step_time_predicted_within_a_factor_of_two(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(bench.TINY_LLAMA))
    seen = []
    for _ in range(ATTEMPTS):
        predicted, measured, share = bench.validate(config, bench.CONFIGS["ulysses-2"])
        ratio = predicted / measured
        seen.append(f"predicted {predicted:.3f} s, measured {measured:.3f} s ({ratio - 1:+.0%}; other processes "
                    f"took {share:.0%} of the CPUs)")
        if 1 / bench.LOADED_FACTOR <= ratio <= bench.LOADED_FACTOR:
            break
    else:
        pytest.fail(f"off by more than {bench.LOADED_FACTOR}x in {ATTEMPTS} runs:\n" + "\n".join(seen))
    print("\n".join(seen))


def test_the_benchmark_verdict_holds_quiet_runs_to_25_percent_and_loaded_ones_to_2x():
    row = lambda name, ratio, share: dict(name=name, predicted=ratio, measured=1.0, share=share, retried=False)  # noqa: E731
    assert bench.verdict([row("ring-4", 1.2, 0.0), row("usp-2x2", 1.1, 0.0)]) == []
    assert bench.verdict([row("ring-4", 1.3, 0.0)]) == ["ring-4: +30%"]
    assert bench.verdict([row("ring-4", 1.3, 0.5)]) == []
    assert bench.verdict([row("ring-4", 2.5, 0.5)]) == ["ring-4: +150%"]
    assert bench.verdict([row("ring-4", 0.8, 0.0), row("usp-2x2", 1.2, 0.0)]) == ["quiet layouts' ratios spread 1.50x"]
