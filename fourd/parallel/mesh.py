"""One DeviceMesh for the whole job, with named dimensions ("dp", "pp", "cp", "tp"), outermost first.

torch lays a mesh of shape (DP, PP, CP, TP) out row-major over ranks 0..N-1, which is exactly the
contract's rank = tp + TP·(cp + CP·(pp + PP·dp)): TP neighbours are consecutive ranks (one server).
With HSDP the dp dimension is split into ("dp_replicate", "dp_shard"), replicate outermost, so that
the parameter shards stay on the nearer ranks and only the gradient all-reduce crosses the far links.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fourd.errors import FourdError
from fourd.layout import Layout

MESH_DIMS = ("dp", "pp", "cp", "tp")


def build_mesh(layout: Layout, device_type: str = "cpu", hsdp_replicate: int | None = None) -> DeviceMesh:
    """The job's mesh; needs an initialised default process group of layout.world ranks."""
    if hsdp_replicate is None:
        return init_device_mesh(device_type, (layout.dp, layout.pp, layout.cp, layout.tp), mesh_dim_names=MESH_DIMS)
    if hsdp_replicate < 1 or layout.dp % hsdp_replicate:
        raise FourdError(
            f"HSDP replicate degree {hsdp_replicate} must divide dp={layout.dp}: choose a divisor of {layout.dp}"
        )
    shape = (hsdp_replicate, layout.dp // hsdp_replicate, layout.pp, layout.cp, layout.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard") + MESH_DIMS[1:])


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that average gradients: DP replicas and CP ranks, which see different tokens of the same
    weights. 1-D ("dp_cp",) normally; 2-D ("dp_replicate", "dp_shard_cp") under HSDP, where the
    parameters are sharded over dp_shard × cp and replicated over dp_replicate.
    """
    names = mesh.mesh_dim_names
    if "dp_replicate" in names:
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard])
    return mesh["dp", "cp"]._flatten("dp_cp")
