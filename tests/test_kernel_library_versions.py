"""Vendor-library kernel curves name the library version that ran them (issue 21, the NeMo 24.03 rows).

cuDNN's fused attention changes speed from release to release (9.0.0 claims up to 50% over 8.9.7 on Hopper,
9.4.0 another 5-30%), so a cuDNN curve is only evidence for runs on the same library version. The stack a
published run used can then be compared with the version behind the kernel data that price it (docs/accuracy.md:
NGC PyTorch 24.02's cuDNN 9.0.0 against the FlashAttention-3 paper's 9.1.1.17)."""

import re

from sp_plan.planner.fitting.kernel_fit import kernel_data

#: Attention kernels that are a vendor library's, not a pinned open-source release.
LIBRARY_KERNELS = {"cudnn": "cuDNN"}


def _versions(text: str, library: str) -> list[str]:
    return re.findall(rf"{library} (\d+\.\d+\.\d+(?:\.\d+)?)", text)


def test_every_cudnn_attention_curve_names_its_cudnn_version():
    data = kernel_data()
    curves = [e for e in data["attention"] if e["kernel"] in LIBRARY_KERNELS]
    assert curves, "kernels.yaml has no cuDNN attention curve: this check would check nothing"
    for entry in curves:
        library = LIBRARY_KERNELS[entry["kernel"]]
        software = data["sources"][entry["source"]].get("software", "")
        assert _versions(software, library), (
            f"{entry['source']}: its {entry['kernel']} curves give no {library} version under sources: software:")


def test_the_fa3_paper_curves_are_cudnn_9_1_1():
    """The FlashAttention-3 paper's Appendix C.1 library list, as the kernel data record it."""
    software = kernel_data()["sources"]["fa3-paper"]["software"]
    assert _versions(software, "cuDNN") == ["9.1.1.17"]
    assert "1830 MHz" in software
