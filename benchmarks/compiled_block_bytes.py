"""The memory-bound bytes a token of fourd's transformer block moves once torch.compile has fused it, as
inductor schedules the block on this machine's CPU, beside fourd.plan.block's count for the same block
(eager and compiled, BF16 autocast over FP32 weights: fourd's precision on one GPU).

    .venv/bin/python benchmarks/compiled_block_bytes.py                       # the 1.5B shape's block
    .venv/bin/python benchmarks/compiled_block_bytes.py --shape 256,8,4,704   # dim,heads,kv_heads,ffn

Inductor compiles the block's forward and backward graphs; every kernel it generates (GEMMs and the
attention kernel, which it calls as library kernels, left out) reads and writes its buffers once, and
their bytes are its scheduler's own count (`get_read_write_buffers_sizes`, read once a graph's code is
generated). The block runs at two batch
sizes and the difference, over the difference in tokens, is the bytes a token (what does not grow with
tokens, the weights' casts, cancels). A CPU's kernels are not a GPU's: inductor fuses alike on both, but
not identically, so this is an estimate of the compiled program's traffic, not a GPU measurement.
"""

from __future__ import annotations

import argparse

import torch
import torch._inductor.graph as inductor_graph
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset, with_overrides
from fourd.model.llama import Rope, TransformerBlock
from fourd.plan.block import traffic
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job

SEQ = 64
BATCHES = (2, 4)
GRAPH_BYTES: list[int] = []  # each compiled graph's generated kernels' bytes, in compile order
INDUCTOR_CODEGEN = inductor_graph.GraphLowering.codegen  # inductor's own, before install_counter


def _codegen_counting(graph, *args, **kwargs):
    """Inductor's code generation for `graph`, then the bytes its generated kernels read and write,
    library kernels left out, appended to GRAPH_BYTES."""
    code = INDUCTOR_CODEGEN(graph, *args, **kwargs)
    generated = [
        node
        for node in graph.scheduler.nodes
        if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode))
    ]
    GRAPH_BYTES.append(sum(node.get_read_write_buffers_sizes() for node in generated))
    return code


def install_counter() -> None:
    """Count every graph inductor compiles from here on (none read back from inductor's or
    AOTAutograd's caches, which would skip the code generation the count reads)."""
    inductor_graph.GraphLowering.codegen = _codegen_counting
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


def compiled_bytes(cfg, batch: int) -> tuple[int, int]:
    """(forward, backward) bytes of the generated kernels of one compiled block at `batch` × SEQ."""
    torch._dynamo.reset()
    GRAPH_BYTES.clear()
    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    cos, sin = Rope(cfg.head_dim, cfg.max_seq, cfg.rope_theta)(SEQ)
    x = torch.randn(batch, SEQ, cfg.dim, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(block)(x, cos, sin)
    out.float().sum().backward()
    forward, backward = GRAPH_BYTES
    return forward, backward


def planned_bytes(cfg, compiled: bool) -> tuple[float, float]:
    """(forward, backward) bytes a token fourd.plan.block counts for the block on one GPU."""
    par = Parallelism(layout=Layout(), recompute="none")
    job = Job(
        model=cfg,
        cluster=load_cluster("dgx-h200"),
        par=par,
        seq=SEQ,
        global_seqs=BATCHES[0],
        precision="bf16",
        compiled=compiled,
    )
    counted = traffic(job.work)
    return counted.forward, counted.backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048,32,8,8192", help="dim,heads,kv_heads,ffn")
    dim, heads, kv_heads, ffn = (int(field) for field in parser.parse_args().shape.split(","))
    cfg = with_overrides(get_preset("debug"), dim=dim, heads=heads, kv_heads=kv_heads, ffn=ffn)
    install_counter()
    small, large = (compiled_bytes(cfg, batch) for batch in BATCHES)
    tokens = (BATCHES[1] - BATCHES[0]) * SEQ
    measured = [(after - before) / tokens for before, after in zip(small, large)]
    print(
        f"block dim {dim}, {heads} heads ({kv_heads} K/V), FFN {ffn}: bytes a token, forward / backward"
    )
    print(f"  inductor on this CPU, compiled   {measured[0]:>10,.0f} / {measured[1]:>10,.0f}")
    for compiled in (True, False):
        forward, backward = planned_bytes(cfg, compiled)
        name = "compiled" if compiled else "eager"
        print(f"  fourd.plan.block, {name:<8}       {forward:>10,.0f} / {backward:>10,.0f}")


if __name__ == "__main__":
    main()
