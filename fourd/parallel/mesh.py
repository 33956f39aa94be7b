"""One DeviceMesh for the whole job, dimensions ("dp", "pp", "cp", "tp") outermost first
(docs/parallelism.md)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fourd.compat import concatenate_meshes, flatten_mesh
from fourd.layout import Layout

MESH_DIMS = ("dp", "pp", "cp", "tp")


def build_mesh(
    layout: Layout, device_type: str = "cpu", hsdp_replicate: int | None = None
) -> DeviceMesh:
    """The job's mesh (row-major, so rank = tp + TP·(cp + CP·(pp + PP·dp))); needs an initialised
    default process group of layout.world ranks. HSDP (validated by fourd.layout.check) splits dp:
    dp_replicate, dp_shard."""
    if hsdp_replicate is None:
        return init_device_mesh(
            device_type, (layout.dp, layout.pp, layout.cp, layout.tp), mesh_dim_names=MESH_DIMS
        )
    shape = (hsdp_replicate, layout.dp // hsdp_replicate, layout.pp, layout.cp, layout.tp)
    return init_device_mesh(
        device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard") + MESH_DIMS[1:]
    )


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that average gradients (DP replicas and CP ranks): 1-D ("dp_cp",), or 2-D
    ("dp_replicate", "dp_shard_cp") under HSDP."""
    if "dp_replicate" in mesh.mesh_dim_names:
        return concatenate_meshes(
            [mesh["dp_replicate"], flatten_mesh(mesh["dp_shard", "cp"], "dp_shard_cp")]
        )
    return flatten_mesh(mesh["dp", "cp"], "dp_cp")
