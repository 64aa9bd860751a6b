"""Device profiles: the rates of a device from its datasheet and stated efficiencies.

Used where no calibration can run, above all for the paper-scale simulation (docs/placement.md,
bench/paper_placement.py). Every number is a datasheet peak times an efficiency said here; none was
measured on such a device in this project.

A100 80 GB SXM (NVIDIA's datasheet): 312 TFLOP/s dense bf16; 2.039 TB/s HBM2e; NVLink 3 at 600 GB/s
per GPU (both directions, so ~300 GB/s a collective's bus sees, of which ~80% is reached);
one 200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s, ~80% reached), as in the paper's cluster;
PCIe 4 x16 to host, ~25 GB/s. Efficiencies: 45% of peak in training and 50% in forward passes
(Megatron-LM's published MFU at these sizes is 40–55%), 70% of HBM bandwidth in decode (vLLM's
memory-bound kernels), 2 ms per engine step (scheduler and sampling with CUDA graphs), 0.1 ms
per decode step per extra tensor-parallel rank (two all-reduces per layer), 0.5 s per stage call
(the controller's round trip and moving the batch) and per weight sync, FSDP's collectives
overlapped with compute (NCCL on its own streams), 80% of PCIe for the trips to host memory that
let a colocated actor and rollout take turns on the GPUs (what this system does; the paper's
3D-HybridEngine keeps both resident instead).
"""

from __future__ import annotations

from hybridflow.planning.cost import Rates

def _datasheet(name: str, bf16_flops_per_s: float, hbm_bytes_per_s: float, nvlink_bytes_per_s: float,
               network_bytes_per_s: float, host_bytes_per_s: float) -> Rates:
    """A GPU's rates from its datasheet peaks times the efficiencies this docstring states: 45% of the
    bf16 peak in training, 50% in forward passes, 70% of HBM bandwidth in decode, ~80% of the links
    reached (`nvlink_bytes_per_s`: what a collective's bus sees, one direction), the same engine,
    call and sync overheads."""
    return Rates(
        train_flops_per_s=0.45 * bf16_flops_per_s,
        forward_flops_per_s=0.50 * bf16_flops_per_s,
        decode_bytes_per_s=0.70 * hbm_bytes_per_s,
        decode_flops_per_s=0.50 * bf16_flops_per_s,
        decode_step_s=2e-3,
        tp_step_s=1e-4,
        call_s=0.5,
        intra_node_bytes_per_s=0.8 * nvlink_bytes_per_s,
        inter_node_bytes_per_s=0.8 * network_bytes_per_s,
        sync_s=0.5,
        host_bytes_per_s=0.8 * host_bytes_per_s,
        comm_overlap=True,
        source=f"{name} SXM datasheet x stated efficiencies (hybridflow/planning/profiles.py)",
    )


A100_80GB = _datasheet("A100 80GB", 312e12, 2.039e12, 300e9, 25e9, 25e9)
A100_MEMORY_BYTES = 80 * 2 ** 30  # 81,920 MiB


# H100 / H200 SXM (NVIDIA's datasheets): 989 TFLOP/s dense bf16 (this project measured 798 on an H200's
# matrix products, 81%); NVLink 4 at 900 GB/s per GPU (~450 a collective's bus sees); one 400 Gb/s NDR
# InfiniBand adapter per GPU (50 GB/s); PCIe 5 x16 to host, 55 GB/s measured from pinned memory on the H200.
H100_80GB = _datasheet("H100 80GB", 989e12, 3.35e12, 450e9, 50e9, 55e9)  # HBM3
H200_141GB = _datasheet("H200 141GB", 989e12, 4.8e12, 450e9, 50e9, 55e9)  # HBM3e

PROFILES = {"a100-80gb": (A100_80GB, A100_MEMORY_BYTES), "h100-80gb": (H100_80GB, 80 * 2 ** 30),
            "h200-141gb": (H200_141GB, 141 * 10 ** 9)}


def default_rates(device: str) -> Rates:
    """The built-in rates of `device`: the A100 profile for cuda, this project's CPU calibration for cpu."""
    if device == "cuda":
        return A100_80GB
    return CPU_XEON_2CORE

# This project's machine (2-core Intel Xeon with AMX, 23.5 GiB): the rates `hybridflow plan --calibrate`
# fitted on bench/placement_validation.py's generation-heavy GRPO workload (bench/results/placement_validation.json).
# They are rates per nominal FLOP (every answer at rollout.max_response_tokens; the tiny model's answers
# stop earlier, hence a "FLOP rate" above the cores'), and fit that workload; calibrate on your own.
CPU_XEON_2CORE = Rates(
    train_flops_per_s=4.394e12, forward_flops_per_s=4.394e12, decode_bytes_per_s=11.90e9,
    decode_flops_per_s=21.52e9, decode_step_s=3.81e-3, tp_step_s=3.99e-3, call_s=0.0247,
    intra_node_bytes_per_s=66.5e6, inter_node_bytes_per_s=66.5e6, sync_s=0.1256, exchange_bytes_per_s=80.4e6,
    send_bytes_per_s=2.378e9, comm_overlap=False,
    source="built-in: calibrated on this project's 2-core Xeon, GRPO with 160-token answers (profiles.py)")
PROFILES["cpu-xeon-2core"] = (CPU_XEON_2CORE, 0.95 * 23.5 * 2 ** 30 / 2)
