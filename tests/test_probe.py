"""Probe discovery without hardware: nvidia-smi parsing, NVML (faked), and building a topology file."""

import pathlib
from types import SimpleNamespace

import pytest

from sp_plan.cost_models.link_fit import TimingSample, predict
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.topology import Topology, load_topology, save_topology
from sp_plan.runtime.probe.build import DeviceFacts, ProbeFacts, build_spec, match_gpu_preset
from sp_plan.runtime.probe.connectivity import connectivity_from_nvml, parse_nvidia_smi_topo
from sp_plan.runtime.probe.host import HostFacts, NicInfo, PcieLink

DATA = pathlib.Path(__file__).parent / "data"


def test_parse_dgx_h100_topo():
    conn = parse_nvidia_smi_topo((DATA / "nvidia_smi_topo_dgx_h100.txt").read_text())
    assert conn.num_gpus == 8 and conn.all_pairs_nvlink() and conn.min_nvlinks() == 18
    assert conn.link_class(0, 5) == "nvlink" and conn.link_class(3, 3) == "self"
    assert conn.nic_names == [f"mlx5_{i}" for i in range(12)]
    assert conn.gpu_nic[0][0] == "PXB" and conn.gpu_nic[0][4] == "SYS"
    assert conn.numa == [0, 0, 0, 0, 1, 1, 1, 1] and conn.sockets() == 2


def test_parse_l40s_pcie_topo_with_spaces():
    conn = parse_nvidia_smi_topo((DATA / "nvidia_smi_topo_l40s_pcie.txt").read_text())
    assert conn.num_gpus == 8 and not conn.all_pairs_nvlink()
    assert [conn.link_class(0, j) for j in (1, 2, 4)] == ["pcie_switch", "pcie_host", "cross_socket"]
    assert conn.gpus_per_switch() == 2 and conn.sockets() == 2
    assert conn.nic_names == ["mlx5_0", "mlx5_1"]


@pytest.mark.parametrize("text, message", [
    ("no topology here", "no GPU0 column header"),
    ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n", "has 1 of 2 columns"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "GPU1 without rows"),
    ("\tGPU0\tGPU1\nGPU0\tNV4\t X \nGPU1\tNV4\t X \n", "not 'X' with itself"),
])
def test_parse_errors(text, message):
    from sp_plan.runtime.errors import RuntimeConfigError

    with pytest.raises(RuntimeConfigError, match=message):
        parse_nvidia_smi_topo(text)


class FakeNvml(SimpleNamespace):
    """pynvml-shaped fake: GPUs 0-3 on NVSwitches (18 links each), GPUs 4-5 a PCIe-only pair."""

    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def nvmlDeviceGetCount(self):
        return 6

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{h:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h >= 4:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=f"00000000:{0x80 + link % 4:02X}:00.0")  # NVSwitch bus ids

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 10 if {a, b} == {4, 5} else 50

    def nvmlDeviceGetNumaNodeId(self, h):
        return 0 if h < 4 else 1


def test_connectivity_from_nvml():
    conn = connectivity_from_nvml(FakeNvml())
    assert conn.gpu_matrix[0][3] == "NV18"
    assert conn.gpu_matrix[4][5] == "PIX" and conn.gpu_matrix[0][4] == "SYS"
    assert conn.numa == [0, 0, 0, 0, 1, 1] and conn.source == "NVML"


def test_match_gpu_preset():
    assert match_gpu_preset("NVIDIA H100 80GB HBM3", 80 << 30) == "h100-80gb"
    assert match_gpu_preset("NVIDIA A100-SXM4-40GB", 40 << 30) == "a100-40gb"
    assert match_gpu_preset("NVIDIA A100-SXM4-80GB", 80 << 30) == "a100-80gb"
    assert match_gpu_preset("NVIDIA L40S", 46 << 30) == "l40s"
    assert match_gpu_preset("Tesla T4", 16 << 30) is None


def _host(nics=()):
    return HostFacts(hostname="node0", cpu_model="Intel Xeon Platinum 8480C", logical_cpus=224, physical_cores=112,
                     sockets=2, ram_bytes=2 << 40, nics=list(nics))


def _timings(group, alpha, bandwidth_by_collective):
    out = []
    for collective, bw in bandwidth_by_collective.items():
        for n in (1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28):
            out.append(TimingSample(collective=collective, group_size=group, nbytes=n,
                                    seconds=predict(collective, group, n, alpha, 1 / bw)))
    return out


def test_build_dgx_spec_from_discovery_and_timings(tmp_path):
    conn = parse_nvidia_smi_topo((DATA / "nvidia_smi_topo_dgx_h100.txt").read_text())
    nics = [NicInfo(f"mlx5_{i}/1", 50e9, "InfiniBand") for i in range(8)] + [NicInfo("mlx5_8/1", 3.125e9, "Ethernet")]
    nvlink = 0.8 * 450e9
    fabric = 0.9 * 50e9
    facts = ProbeFacts(
        hosts=["node0", "node1"],
        local_world=8,
        host=_host(nics),
        device=DeviceFacts(kind="cuda", name="NVIDIA H100 80GB HBM3", memory_bytes=85520809984,
                           matmul_flops={"bf16": 0.75 * 989.4e12}, attention_forward_flops=0.6 * 989.4e12,
                           attention_backward_flops=0.45 * 989.4e12, memory_bandwidth=0.9 * 3.35e12,
                           host_to_device=50e9),
        connectivity=conn,
        pcie_links=[PcieLink(5, 16)] * 8,
        host_memory_bandwidth=400e9,
        intra_samples=_timings(8, 3e-6, dict.fromkeys(("all_reduce", "all_to_all", "send_recv"), nvlink)),
        inter_samples=_timings(2, 8e-6, dict.fromkeys(("all_reduce", "all_to_all", "send_recv"), fabric)),
    )
    spec = build_spec(facts)
    assert spec.gpu == "h100-80gb" and spec.nodes == 2 and spec.node.gpus == 8
    assert spec.node.interconnect.kind == "nvswitch" and spec.node.interconnect.bandwidth == 450e9
    assert spec.fabric.kind == "infiniband" and spec.fabric.nics_per_node == 8
    assert spec.calibration.compute.matmul == pytest.approx(0.75)
    assert spec.calibration.compute.pcie == pytest.approx(50e9 / (3.938e9 * 16))
    topo = load_topology(str(save_topology(spec, tmp_path / "dgx.yaml")))
    assert topo.links["nvlink"].bandwidth == pytest.approx(nvlink, rel=1e-6)
    assert topo.links["nvlink"].alpha == pytest.approx(3e-6, rel=1e-6)
    assert topo.links["fabric"].bandwidth == pytest.approx(fabric, rel=1e-6)
    assert topo.links["fabric"].alpha == pytest.approx(8e-6, rel=1e-6)
    assert any("nvlink link" in m for m in spec.provenance.measured)


def test_build_pcie_spec_accounts_for_congestion():
    """On a PCIe tree the 8-GPU all-to-all is slower than a pair: the fit must divide by the
    congested nominal bandwidth, so the stored efficiency reproduces the measured times."""
    conn = parse_nvidia_smi_topo((DATA / "nvidia_smi_topo_l40s_pcie.txt").read_text())
    base = ProbeFacts(hosts=["box"], local_world=8, host=_host(),
                      device=DeviceFacts(kind="cuda", name="NVIDIA L40S", memory_bytes=48305799168,
                                         matmul_flops={"bf16": 250e12}),
                      connectivity=conn, pcie_links=[PcieLink(4, 16)] * 8)
    topo0 = Topology(build_spec(base))
    span = topo0.group(1, 8)
    assert span.intra_class == "cross_socket"
    achieved = {"all_to_all": 0.7 * span.a2a_bandwidth, "all_reduce": 0.7 * span.ring_bandwidth,
                "send_recv": 0.7 * span.ring_bandwidth}
    base.intra_samples = _timings(8, 5e-6, achieved)
    spec = build_spec(base)
    topo = Topology(spec)
    assert spec.node.interconnect.kind == "pcie" and spec.node.pcie.gpus_per_switch == 2
    assert topo.links["cross_socket"].efficiency == pytest.approx(0.7, rel=1e-6)
    assert topo.group(1, 8).a2a_bandwidth == pytest.approx(achieved["all_to_all"], rel=1e-6)
    assert any("attention forward" in m for m in spec.provenance.not_measured)


def test_build_cpu_spec_single_rank_says_what_it_could_not_measure():
    facts = ProbeFacts(hosts=["laptop"], local_world=1, host=_host(),
                       device=DeviceFacts(kind="cpu", name="Intel Xeon", memory_bytes=64 << 30,
                                          matmul_flops={"fp32": 1e12, "bf16": 5e11}, memory_bandwidth=20e9),
                       not_measured=["links (single process)"])
    spec = build_spec(facts)
    assert spec.node.interconnect.kind == "loopback" and spec.fabric is None
    assert spec.gpu.peak_flops["fp32"] == 1e12 and spec.calibration.compute.matmul == 1.0
    assert any("inter-node fabric" in m for m in spec.provenance.not_measured)
    Topology(spec)


def test_build_without_any_matmul_measurement_fails_clearly():
    facts = ProbeFacts(hosts=["x"], local_world=1, host=_host(),
                       device=DeviceFacts(kind="cpu", name="cpu", memory_bytes=1 << 30))
    with pytest.raises(CostModelError, match="no matmul throughput"):
        build_spec(facts)


def test_latency_bound_timings_degrade_gracefully():
    flat = [TimingSample(collective="send_recv", group_size=2, nbytes=n, seconds=1e-4) for n in (1024, 2048, 4096)]
    facts = ProbeFacts(hosts=["x"], local_world=2, host=_host(),
                       device=DeviceFacts(kind="cpu", name="cpu", memory_bytes=1 << 30, matmul_flops={"fp32": 1e11},
                                          memory_bandwidth=5e9),
                       intra_samples=flat)
    spec = build_spec(facts)
    assert spec.node.interconnect.bandwidth == 5e9
    assert any("do not grow with message size" in m for m in spec.provenance.not_measured)
    # ... but they do measure gloo's latency: 100 us per send/recv step, half of it per graph hop.
    assert spec.node.interconnect.latency == pytest.approx(5e-5)


def test_cpu_attention_fraction_is_of_the_measured_dtype_and_shape_corrected():
    """CPU attention is timed in fp32 at one causal shape: its fraction is of the fp32 matmul rate (not
    bf16's, twice as fast on CPU) and divided by the kernel model's efficiency for that shape, so the
    time model gives the benchmark's own shape back the measured rate."""
    from sp_plan.cost_models.kernels import attention_shape_efficiency, prior_kernel_model

    shape = (1, 4, 1024, 64)
    facts = ProbeFacts(hosts=["x"], local_world=1, host=_host(),
                       device=DeviceFacts(kind="cpu", name="EPYC", memory_bytes=1 << 30,
                                          matmul_flops={"fp32": 50e9, "bf16": 110e9}, memory_bandwidth=5e9,
                                          attention_forward_flops=20e9, attention_backward_flops=10e9,
                                          attention_dtype="fp32", attention_shape=shape))
    spec = build_spec(facts)
    kernels = prior_kernel_model(spec.gpu.name)
    eff = attention_shape_efficiency(4, 1024, 1024, 64, True, kernels.attention["fa2"], kernels.sms)
    assert 0 < eff < 1
    compute = spec.calibration.compute
    assert compute.attention_forward == pytest.approx(20e9 / (50e9 * eff))
    assert compute.attention_backward == pytest.approx(10e9 / (50e9 * eff))
    assert any("bf16 runs" in n for n in spec.provenance.notes)


def test_cpu_attention_faster_than_gemms_raises_the_peak_not_the_fractions():
    """Ranks sharing cores can run attention faster (shape-corrected) than GEMMs: the fractions stay within
    the kernel model's bound of 1 (sp-plan calibrate fits within it) and every kernel keeps its rate."""
    from sp_plan.cost_models.kernels import attention_shape_efficiency, prior_kernel_model

    facts = ProbeFacts(hosts=["x"], local_world=4, host=_host(),
                       device=DeviceFacts(kind="cpu", name="EPYC", memory_bytes=1 << 30,
                                          matmul_flops={"fp32": 20e9, "bf16": 45e9}, memory_bandwidth=5e9,
                                          attention_forward_flops=13e9, attention_backward_flops=6e9,
                                          attention_dtype="fp32", attention_shape=(1, 4, 1024, 64)))
    spec = build_spec(facts)
    compute = spec.calibration.compute
    kernels = prior_kernel_model(spec.gpu.name)
    eff = attention_shape_efficiency(4, 1024, 1024, 64, True, kernels.attention["fa2"], kernels.sms)
    assert 13e9 / (20e9 * eff) > 1  # the case this test is about
    assert max(compute.matmul, compute.attention_forward, compute.attention_backward) == pytest.approx(1.0)
    peak = spec.gpu.peak_flops
    assert peak["fp32"] * compute.matmul == pytest.approx(20e9)
    assert peak["bf16"] * compute.matmul == pytest.approx(45e9)
    assert peak["fp32"] * compute.attention_forward * eff == pytest.approx(13e9)
    assert peak["fp32"] * compute.attention_backward * eff == pytest.approx(6e9)
    kernels.with_values({"attention.fa2.forward_fraction": compute.attention_forward,
                         "gemm.peak_fraction": compute.matmul})  # within the kernel model's bounds
