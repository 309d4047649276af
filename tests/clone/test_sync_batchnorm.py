"""Clone-mode SyncBatchNorm across 2 gloo ranks equals clone BatchNorm on the global batch."""
import os
import sys
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import jvpreg
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

    wr = w.clone().requires_grad_(True)
    rm, rv = torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype)
    y, t = jvpreg.jvp(lambda z: F.batch_norm(z, rm, rv, wr, b, True, 0.1, 1e-5), (x,), (u,))
    (gw,) = torch.autograd.grad(t.pow(2).sum() + y.pow(2).sum(), wr)

    torch.testing.assert_close(torch.cat([p["y"] for p in parts]), y.detach())
    torch.testing.assert_close(torch.cat([p["t"] for p in parts]), t.detach())
    torch.testing.assert_close(parts[0]["gw"] + parts[1]["gw"], gw)  # DDP sums the ranks' gradients
    for p in parts:
        torch.testing.assert_close(p["rm"], rm)
        torch.testing.assert_close(p["rv"], rv)
