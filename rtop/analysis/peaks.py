"""The dense peak throughput of known GPUs, by precision: what model FLOPs are measured
against for MFU (model FLOPs utilization).

Figures are the vendors' datasheet numbers for dense math (the "with sparsity" figures
halved, never used as they are), in TFLOPS, on Tensor Cores (matrix cores) for tf32,
bf16, fp16 and fp8, and the vector units for fp32. A GPU or a precision not listed has no
peak: MFU is then "n/a", never a guess. GPUs are found by the name NVML gives (``NVIDIA
H100 80GB HBM3``, ``NVIDIA A100-SXM4-40GB``, ``Tesla V100-SXM2-16GB``; AMD's ``AMD
Instinct MI300X`` as ROCm names it), in :data:`MODELS`' order: the first pattern that
matches names the model.
"""

from __future__ import annotations

import re
from typing import Final

#: Dense peak TFLOPS per GPU model and precision (see the module doc for the sources).
PEAK_TFLOPS: Final[dict[str, dict[str, float]]] = {
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: FP32 67; TF32 989, BF16
    # 1,979, FP16 1,979, FP8 3,958 TFLOPS with sparsity
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5,
                 "fp8": 1979.0},
    # ... H100 PCIe: FP32 51; TF32 756, BF16 1,513, FP16 1,513, FP8 3,026 with sparsity
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5,
                  "fp8": 1513.0},
    # ... H100 NVL: FP32 60; TF32 835, BF16 1,671, FP16 1,671, FP8 3,341 with sparsity
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5,
                 "fp8": 1670.5},
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: FP32 67; TF32 989, BF16
    # 1,979, FP16 1,979, FP8 3,958 TFLOPS with sparsity (the H100 SXM's compute)
    "H200 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5,
                 "fp8": 1979.0},
    # ... H200 NVL: FP32 60; TF32 835, BF16 1,671, FP16 1,671, FP8 3,341 with sparsity
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5,
                 "fp8": 1670.5},
    # NVIDIA A100 Tensor Core GPU datasheet (40 GB and 80 GB, PCIe and SXM alike): FP32
    # 19.5; TF32 156, BF16 312, FP16 312 (twice that with sparsity); no FP8
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # NVIDIA L40S datasheet: FP32 91.6; TF32 183, BF16 362.05, FP16 362.05, FP8 733
    # (366, 733, 733, 1,466 with sparsity)
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
    # NVIDIA A10 datasheet: FP32 31.2; TF32 62.5, BF16 125, FP16 125 (twice that with
    # sparsity); no FP8
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    # NVIDIA V100 datasheet: V100 SXM2 FP32 15.7, Tensor Core (FP16) 125; V100 PCIe 14 and
    # 112; V100S PCIe 16.4 and 130; no TF32, BF16 or FP8 (Volta has none)
    "V100 SXM2": {"fp32": 15.7, "fp16": 125.0},
    "V100 PCIe": {"fp32": 14.0, "fp16": 112.0},
    "V100S PCIe": {"fp32": 16.4, "fp16": 130.0},
    # NVIDIA DGX B200 / HGX B200 datasheet, 8 GPUs: FP32 600 TFLOPS (dense); TF32 18,
    # FP16/BF16 36, FP8 72 PFLOPS with sparsity: per GPU dense 75, 1,125, 2,250, 4,500
    "B200": {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    # AMD Instinct MI300X datasheet: FP32 (vector) 163.4; TF32 653.7, FP16 1,307.4, BF16
    # 1,307.4, FP8 2,614.9 dense (twice that with sparsity)
    "MI300X": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4,
               "fp8": 2614.9},
}

#: (pattern over the upper-cased NVML name, model), the more specific first.
MODELS: Final[tuple[tuple[str, str], ...]] = (
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200 SXM"),
    (r"H100.*PCIE", "H100 PCIe"),
    (r"H100.*NVL", "H100 NVL"),
    (r"H100", "H100 SXM"),  # NVML: "NVIDIA H100 80GB HBM3"
    (r"A100", "A100"),
    (r"L40S", "L40S"),
    (r"\bA10\b", "A10"),  # not the A100, not the A10G
    (r"V100S", "V100S PCIe"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100 SXM2"),
    (r"B200", "B200"),
    (r"MI300X", "MI300X"),
)
#: The precision assumed when no rank says (mixed-precision training's usual one).
DEFAULT_DTYPE: Final = "bf16"


def gpu_model(name: str | None) -> str | None:
    """The model of :data:`PEAK_TFLOPS` an NVML GPU name is, or None (not known)."""
    if not name:
        return None
    upper = name.upper()
    for pattern, model in MODELS:
        if re.search(pattern, upper):
            return model
    return None


def peak_flops(name: str | None, dtype: str | None) -> float | None:
    """The dense peak FLOP/s of a GPU (by its NVML name) at ``dtype``; None when the GPU
    or that precision on it is not known."""
    model = gpu_model(name)
    if model is None or dtype is None:
        return None
    tflops = PEAK_TFLOPS[model].get(dtype)
    return tflops * 1e12 if tflops is not None else None
