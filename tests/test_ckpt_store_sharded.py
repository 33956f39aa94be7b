"""A checkpoint saved by 2 gloo ranks holding DTensor shards loads in one process, bit-exact, with the
same model_digest as a single-process save of the same weights."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_util import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fourd.ckpt import store
from fourd.model.config import get_preset
from fourd.model.llama import build_model

pytestmark = pytest.mark.slow  # gloo ranks

CFG = get_preset("debug")


def _save_sharded(rank, world, final):
    mesh = init_device_mesh("cpu", (world,))
    full = build_model(CFG, seed=11).state_dict()
    # every matrix split by rows across the ranks; the norms replicated
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() == 2 else v for k, v in full.items()}
    tmp = store.staging_dir(final)
    if rank == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(str(tmp)))
    digest = store.model_digest(sd)  # a collective: every rank gathers the full tensors
    dist.barrier()
    if rank == 0:
        store.write_manifest(tmp, cfg=CFG, digest=digest, step=4, layout=f"tp={world}")
        store.commit(tmp, final)
    dist.barrier()
    return digest


def test_sharded_save_loads_in_one_process(tmp_path):
    final = tmp_path / "step-4"
    digests = run_ranks(_save_sharded, 2, final, timeout=120)
    full = build_model(CFG, seed=11).state_dict()
    assert digests[0] == digests[1] == store.model_digest(full)
    manifest = store.verify(final)
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    cfg, sd = store.load_model_checkpoint(final)
    assert cfg == CFG and sorted(sd) == sorted(full)
    assert all(torch.equal(sd[k], full[k]) for k in full)
    single = tmp_path / "single"
    store.save_model_checkpoint(single, CFG, full)
    assert store.read_manifest(single)["model_digest"] == manifest["model_digest"]
