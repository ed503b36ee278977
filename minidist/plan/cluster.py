"""GPUs and the links between them, from the datasheets.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm

Peaks are the dense 16-bit (bf16/fp16) tensor-core figures, never the sparse ones
(which the datasheets print beside them at twice the value):
  A100 80GB SXM  312 TFLOP/s, 80 GB HBM2e at 2,039 GB/s  (NVIDIA A100 Tensor Core GPU
                 datasheet, "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*", * = sparsity)
  H100 SXM       989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s    (NVIDIA H100 Tensor Core GPU
                 datasheet, "BF16 Tensor Core 1,979 teraFLOPS*", * = with sparsity: 989 dense)
  H200 (SXM)     989 TFLOP/s, 141 GB HBM3e at 4.8 TB/s   (NVIDIA H200 datasheet; the same
                 Hopper tensor cores as H100 SXM, "1,979 TFLOPS*" with sparsity)

Memory is what nvidia-smi reports as a GPU's total, the datasheets' "80 GB" and "141 GB"
being round names: A100 80GB 81,920 MiB (85.9e9 bytes), H100 80GB HBM3 81,559 MiB
(85.5e9), H200 143,771 MiB (150.8e9); a layout fits in 90% of it (cost.USABLE_MEMORY).

Links, bytes per second per GPU in one direction (the ring's bottleneck):
  NVLink 3 (A100)  600 GB/s bidirectional -> 300 GB/s each way (A100 datasheet)
  NVLink 4 (H100, H200)  900 GB/s bidirectional -> 450 GB/s each way (H100 datasheet)
  InfiniBand, one NIC per GPU: DGX A100 / Selene 8 x 200 Gb/s HDR -> 25 GB/s per GPU
  (Narayanan et al. 2021, section 5; DGX A100 user guide); DGX H100 8 x 400 Gb/s NDR ->
  50 GB/s per GPU (DGX H100 user guide); Llama 3's RoCE fabric is also 400 Gb/s per GPU
  (Grattafiori et al. 2024, arXiv 2407.21783, section 3.3.1).
Achieved bandwidth (Cluster.link): across nodes the node's NICs are shared by the groups
crossing at once (this project's contention model); with link_efficiency, each link class
at Calculon's achieved fraction (NVLink 0.6, InfiniBand 0.9; Isaev et al., SC'23).
Latencies (alpha, seconds per message step) are this project's round figures, not a
datasheet's: 5 us inside a node, 10 us across nodes (NCCL's per-step latencies are of
that order; they matter only for small messages and long rings).

matmul_efficiency: the fraction of the dense peak that the training step's matrix
products reach, one number per GPU type, set once (below; docs/reference.md#the-planner;
cost.py shows what it multiplies). It is never tuned per layout or per row.
HBM bandwidth times the elementwise kernels' bytes gives their time (cost.py).
"""
from dataclasses import dataclass, replace

GB = 1e9
MIB = 2 ** 20


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # dense 16-bit tensor-core FLOP/s
    memory_bytes: float        # HBM capacity
    hbm_bytes_per_s: float     # HBM bandwidth
    matmul_efficiency: float   # fraction of peak_flops the matrix products reach
    intra_bw: float            # NVLink, bytes/s per GPU, one direction
    inter_bw: float            # network, bytes/s per GPU, one direction
    source: str
    sms: int = 0               # streaming multiprocessors (plan.gemm's waves; 0: no GEMM shapes)
    intra_efficiency: float = 1.0   # achieved / datasheet bandwidth, NVLink (Calculon's figure)
    inter_efficiency: float = 1.0   # the same, the network


# The efficiencies, one rule for each GPU type, applied once: the value (to 0.01) that
# minimises the worst relative error over that type's published rows (plan.published), then
# the next worst where rows the constant cannot move share the worst (plan.published.fit;
# tests/test_plan.py checks that 0.01 either way is worse; plan.published.fit_constants()
# recomputes both, to be rerun after any change to the cost model). One number for 27 A100
# rows from five sources and one for 13 H100 rows from two: the spread left is the model's,
# and lesson 12 prints each row's error with the constant fitted WITHOUT its source
# (leave-one-source-out) beside it. H200 has no published row here; it keeps H100's tensor
# cores and so H100's figure. Read them as "the fraction of peak a whole training step's
# matrix products reached", not as a GEMM benchmark: H100's absorbs what the planner does not
# model of Llama 3's and MosaicML's runs (FSDP's details, how Meta counts causal attention's
# FLOPs, attention kernels slower than the GEMMs, stragglers); large bf16 GEMMs alone reach
# well above it. History: A100 0.69 and H100 0.52 over the 21 rows of Korthikanti,
# Narayanan and Llama 3 (H100 fitted partly to the 128K row, whose DP 8 is inferred: Table 4
# prints DP 4, which fits neither its 16,384 GPUs nor its 16M tokens); 0.63 and 0.51 once
# MT-NLG, BLOOM and MosaicML's rows joined; unchanged (refitted: the same values) once groups
# crossing nodes share the node's NICs (Cluster.link), which moved MosaicML's FSDP rows on 16
# to 64 GPUs from 40-46% too slow to 17-19% too fast. GEMM shapes (plan.gemm) and Calculon's
# link efficiencies, fitted with everything else, would give 0.68 and 0.52, and made the
# held-out error worse: both are off unless asked (make_cluster's gemm_shapes,
# link_efficiency; docs/reference.md#the-planner).
A100_EFFICIENCY = 0.63
H100_EFFICIENCY = 0.51

# Achieved fraction of each link class's datasheet bandwidth, Calculon's figures (Isaev et
# al., "Calculon", SC'23; calculon-ai/calculon systems/a100_80g.json and h100_80g_nvl8.json:
# "efficiency" 0.6 for the NVLink network of 8, 0.9 for the InfiniBand one), taken as they
# are, not fitted here.
NVLINK_EFFICIENCY = 0.6
NETWORK_EFFICIENCY = 0.9

GPUS = {
    "a100-80gb": GPU("a100-80gb", 312e12, 81920 * MIB, 2039 * GB, A100_EFFICIENCY, 300 * GB, 25 * GB,
                     "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80 GB, 2,039 GB/s, NVLink 600 GB/s",
                     108, NVLINK_EFFICIENCY, NETWORK_EFFICIENCY),
    "h100-sxm": GPU("h100-sxm", 989e12, 81559 * MIB, 3350 * GB, H100_EFFICIENCY, 450 * GB, 50 * GB,
                    "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (SXM), 80 GB, 3.35 TB/s, NVLink 900 GB/s",
                    132, NVLINK_EFFICIENCY, NETWORK_EFFICIENCY),
    "h200": GPU("h200", 989e12, 143771 * MIB, 4800 * GB, H100_EFFICIENCY, 450 * GB, 50 * GB,
                "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16, 141 GB, 4.8 TB/s, NVLink 900 GB/s",
                132, NVLINK_EFFICIENCY, NETWORK_EFFICIENCY),
}

INTRA_ALPHA = 5e-6     # seconds per message step inside a node (this project's figure)
INTER_ALPHA = 10e-6    # across nodes


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int
    intra_bw: float       # bytes/s per GPU, one direction, inside a node
    intra_alpha: float    # seconds
    inter_bw: float       # bytes/s per GPU, one direction, across nodes
    inter_alpha: float
    contention: bool = True   # groups crossing at once share the node's NICs (link())
    link_efficiency: bool = False   # links at Calculon's efficiencies (off: the datasheets')
    gemm_shapes: bool = False       # each GEMM at its shape's efficiency (plan.gemm; off: 1)

    def link(self, span, per_node=1, crossing=None):
        """(alpha, achieved bandwidth per GPU) of a group whose ranks lie within `span`
        consecutive ranks: NVLink when that fits in a node, the network otherwise, each at
        its class's efficiency (GPU.intra_efficiency, inter_efficiency: Calculon's).

        Across nodes the node's NICs, gpus_per_node x inter_bw together, are shared by the
        groups that cross at once (contention; this project's model): `crossing` of the
        node's GPUs (default all of them) send across in this phase, in groups holding
        `per_node` of the node's GPUs each (ranks_per_node), so crossing / per_node groups
        split the NICs, and one ring of a group, whose bytes leave the node once per ring
        (NCCL lays one ring per NIC), moves its GPU's bytes at node NICs x per_node /
        crossing, never faster than the NVLink hops it also takes. One GPU per node
        (Megatron's DP over TP 8) gets its own NIC, inter_bw; FSDP over whole nodes gets
        the node's NICs. contention False (a measured machine's links): inter_bw."""
        g, eff = self.gpu, self.link_efficiency
        nvlink = self.intra_bw * (g.intra_efficiency if eff else 1.0)
        if span <= self.gpus_per_node:
            return self.intra_alpha, nvlink
        inter = self.inter_bw * (g.inter_efficiency if eff else 1.0)
        if not self.contention:
            return self.inter_alpha, inter
        node = self.gpus_per_node * inter
        crossing = self.gpus_per_node if crossing is None else crossing
        return self.inter_alpha, min(nvlink, node * per_node / max(crossing, per_node))


def ranks_per_node(stride, size, gpus_per_node):
    """How many of a group's `size` ranks, `stride` ranks apart, share one node (at least 1):
    a DP group over TP 8 has 1 per node of 8, FSDP over whole nodes 8."""
    return max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1


def make_cluster(gpu_name, gpus, gpus_per_node=8, intra_bw=None, intra_alpha=INTRA_ALPHA,
                 inter_bw=None, inter_alpha=INTER_ALPHA, gpu=None, contention=None,
                 link_efficiency=False, gemm_shapes=False):
    """A Cluster of `gpus` GPUs of a GPUS type (or a given GPU), nodes of gpus_per_node.
    contention None: on for a datasheet GPU (a GPUS name), off for a measured one (its
    links are measured per rank). link_efficiency, gemm_shapes: the two terms that made the
    held-out error worse (docs/reference.md#the-planner), off unless asked. Raises ValueError (one line) for an unknown name or a
    count that fills no whole node."""
    if gpu is None:
        if gpu_name not in GPUS:
            raise ValueError(f"unknown GPU {gpu_name!r}: one of {', '.join(GPUS)}")
        gpu = GPUS[gpu_name]
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"need at least one GPU and one GPU per node, not {gpus} and {gpus_per_node}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs is not a multiple of the node size {gpus_per_node}")
    return Cluster(gpu, gpus, gpus_per_node, gpu.intra_bw if intra_bw is None else intra_bw,
                   intra_alpha, gpu.inter_bw if inter_bw is None else inter_bw, inter_alpha,
                   gpu.name in GPUS if contention is None else contention, link_efficiency,
                   gemm_shapes)


def with_efficiency(gpu, efficiency):
    """The same GPU with another matmul efficiency (for sensitivity tables, never per row)."""
    return replace(gpu, matmul_efficiency=efficiency)
