"""Alpha-beta fitting on synthetic timings with known parameters, and its use in a topology."""

import numpy as np
import pytest

from sp_plan.cost_models import CostModelError, Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.link_fit import TimingSample, fit_alpha_beta, link_calibration, predict
from sp_plan.cost_models.time_model import comm_and_time
from sp_plan.cost_models.topology import CalibrationSpec, Topology, get_preset_spec, resize

SIZES = [2**k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB


def synthetic(alpha, bandwidth, group=8, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for collective in ("all_reduce", "all_to_all", "send_recv"):
        for n in SIZES:
            t = predict(collective, group, n, alpha, 1 / bandwidth)
            samples.append(TimingSample(collective=collective, group_size=group, nbytes=n,
                                        seconds=t * (1 + noise * rng.standard_normal())))
    return samples


@pytest.mark.parametrize("alpha, bandwidth", [(2e-6, 360e9), (8e-6, 45e9), (30e-6, 2.5e9), (1e-4, 1e8)])
def test_exact_recovery_without_noise(alpha, bandwidth):
    fit = fit_alpha_beta(synthetic(alpha, bandwidth))
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.max_relative_error < 1e-6


def test_recovery_with_two_percent_noise():
    fit = fit_alpha_beta(synthetic(5e-6, 300e9, noise=0.02, seed=1))
    assert fit.alpha == pytest.approx(5e-6, rel=0.05)
    assert fit.bandwidth == pytest.approx(300e9, rel=0.03)
    assert 0.005 < fit.rms_relative_error < 0.05


def test_fit_needs_enough_and_varied_samples():
    one = synthetic(1e-6, 1e9)[:2]
    with pytest.raises(CostModelError, match="at least 3"):
        fit_alpha_beta(one)
    same = [TimingSample(collective="send_recv", group_size=2, nbytes=1024, seconds=1e-5)] * 4
    with pytest.raises(CostModelError, match="several sizes"):
        fit_alpha_beta(same)
    shrinking = [TimingSample(collective="send_recv", group_size=2, nbytes=n, seconds=1e-3 / n)
                 for n in (1024, 2048, 4096, 8192)]
    with pytest.raises(CostModelError, match="do not grow with message size"):
        fit_alpha_beta(shrinking)


def test_fitted_calibration_drives_predictions():
    fit = fit_alpha_beta(synthetic(4e-6, 180e9))
    spec = resize(get_preset_spec("dgx-h100"), 8)
    calibrated = spec.model_copy(update={"calibration": CalibrationSpec(
        source="probe", links={"nvlink": link_calibration(fit, "synthetic")})})
    topo = Topology(calibrated)
    assert topo.links["nvlink"].bandwidth == pytest.approx(180e9)
    assert topo.links["nvlink"].alpha == pytest.approx(4e-6)
    assert "synthetic" in calibrated.calibration.links["nvlink"].fitted_from
    model = get_model_preset("llama3-8b")
    t = comm_and_time(model, TrainSpec(seq_len=65536, mode="prefill", zero_stage=0), Layout(ulysses=8), topo).time
    q = 8192 * 32 * 128 * 2
    kv = 8192 * 8 * 128 * 2
    expected = 32 * (4 * 7 * 4e-6 + 7 / 8 * (2 * q + 2 * kv) / 180e9)
    assert t.comm_s_by_strategy["ulysses"] == pytest.approx(expected)


def test_fit_against_nominal_bandwidth_gives_an_efficiency():
    nominal = {"all_reduce": 200e9, "all_to_all": 100e9, "send_recv": 250e9}  # patterns congest differently
    samples = []
    for collective, bw in nominal.items():
        for n in SIZES:
            t = predict(collective, 4, n, 3e-6, 1 / (0.7 * bw))
            samples.append(TimingSample(collective=collective, group_size=4, nbytes=n, seconds=t,
                                        nominal_bandwidth=bw))
    fit = fit_alpha_beta(samples)
    assert fit.efficiency == pytest.approx(0.7, rel=1e-6) and fit.bandwidth is None
    assert fit.alpha == pytest.approx(3e-6, rel=1e-6)
    entry = link_calibration(fit, "probe")
    assert entry.efficiency == pytest.approx(0.7) and entry.bandwidth is None
    with pytest.raises(CostModelError, match="every timing or for none"):
        fit_alpha_beta(samples[:3] + [samples[3].model_copy(update={"nominal_bandwidth": None})])
