"""Clone-mode SyncBatchNorm across 2 gloo ranks equals torch.func.jvp of BatchNorm on the global batch (float64)."""
import os
import sys
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import jvpreg
from conftest import assert_tree_close
from jvpreg.clone import pack, unpack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, x, u, w, b, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.nn.modules._functions import SyncBatchNorm as SyncBN

    n = x.shape[0] // world
    xs, us = x[rank * n:(rank + 1) * n], u[rank * n:(rank + 1) * n]
    w = w.clone().requires_grad_(True)
    rm, rv = torch.zeros(w.shape[0], dtype=x.dtype), torch.ones(w.shape[0], dtype=x.dtype)
    (cx,), s = pack((xs,), (us[None],))
    y = jvpreg.clone.call(lambda c: SyncBN.apply(c, w, b, rm, rv, 1e-5, 0.1, dist.group.WORLD, world), (cx,))
    y0, t = unpack(y, s, batched=False)
    (gw,) = torch.autograd.grad(t.pow(2).sum() + y0.pow(2).sum(), w)
    torch.save({"y": y0.detach(), "t": t.detach(), "gw": gw, "rm": rm, "rv": rv}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    # no interpreter teardown: under load a thread left at exit can abort a worker whose work is done
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_sync_batchnorm_matches_global_batch(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    u = torch.randn_like(x)
    w, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    mp.spawn(_worker, args=(2, _free_port(), x, u, w, b, str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]

    # float64 references from torch alone: torch.func.jvp of train-mode batch norm on the global batch (no running
    # stats: the functional form), its penalty's gradient by torch.func.grad, and the running stats by a plain call
    def primal_and_tangent(weight):
        return torch.func.jvp(lambda z: F.batch_norm(z, None, None, weight, b, True, 0.1, 1e-5), (x,), (u,))

    y, t = primal_and_tangent(w)
    gw = torch.func.grad(lambda weight: sum(v.pow(2).sum() for v in primal_and_tangent(weight)))(w)
    rm, rv = torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype)
    F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)

    assert_tree_close(torch.cat([p["y"] for p in parts]), y, what="primal")
    assert_tree_close(torch.cat([p["t"] for p in parts]), t, what="tangent")
    assert_tree_close(parts[0]["gw"] + parts[1]["gw"], gw, what="weight gradient")  # DDP sums the ranks' gradients
    for p in parts:
        assert_tree_close((p["rm"], p["rv"]), (rm, rv), what="running stats")
