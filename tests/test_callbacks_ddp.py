"""DDP on CPU (``ddp_spawn``, gloo, 2 processes): regularized training equals a single-process simulation.

Runs without SyncBatchNorm: PyTorch's ``nn.SyncBatchNorm`` refuses CPU tensors, so each rank's
train-mode BatchNorm uses its own (primal) rows, which is what the simulation does too.
"""
from __future__ import annotations

import copy
import os

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from conftest import once_more_if_a_spawned_worker_aborts_at_exit
from jvpreg.callbacks import JacobianRegularizer, TangentPropRegularizer
from jvpreg.losses import regularized_forward

LAM = 0.25


class DDPLit(pl.LightningModule):
    def __init__(self, net: nn.Module, dataset=None):
        super().__init__()
        self.net, self.dataset = net, dataset

    def train_dataloader(self):  # rank r gets samples r, r + 2, ... in order (no shuffling)
        sampler = torch.utils.data.DistributedSampler(self.dataset, num_replicas=2, rank=self.global_rank,
                                                      shuffle=False)
        return torch.utils.data.DataLoader(self.dataset, batch_size=4, sampler=sampler)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def net_bn():
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_spawn_cpu_matches_single_process_simulation():
    torch.manual_seed(0)
    net = net_bn()
    g = torch.Generator().manual_seed(100)
    x, y = torch.randn(16, 1, 4, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
    cbs = [JacobianRegularizer(LAM, seed=0), TangentPropRegularizer(LAM, transforms="rotate")]
    penalties = [[copy.deepcopy(c.penalty) for c in cbs] for _ in range(2)]  # one generator state per rank

    def fit():
        model = DDPLit(copy.deepcopy(net), torch.utils.data.TensorDataset(x, y))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2,
                             callbacks=copy.deepcopy(cbs), logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
        trainer.fit(model)
        return model

    model = once_more_if_a_spawned_worker_aborts_at_exit(fit)

    sim = copy.deepcopy(net)
    opt = torch.optim.SGD(sim.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        for rank in range(2):
            idx = torch.arange(rank, 16, 2)[4 * step:4 * step + 4]
            out, pen = regularized_forward(sim, x[idx], penalties[rank])  # both penalties, one forward
            ((F.cross_entropy(out, y[idx]) + LAM * pen) / 2).backward()
        opt.step()
    for (n, a), b in zip(model.net.named_parameters(), sim.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_the_spawn_retry_runs_once_more_only_for_an_abort_at_exit():
    def failing(signal_name, then=None):
        calls = []

        def run():
            calls.append(1)
            if len(calls) == 1 or then is None:
                raise torch.multiprocessing.ProcessExitedException(
                    "process 1 terminated", error_index=1, error_pid=1, exit_code=-6, signal_name=signal_name)
            return then
        return run, calls

    run, calls = failing("SIGABRT", then=42)
    assert once_more_if_a_spawned_worker_aborts_at_exit(run) == 42 and len(calls) == 2
    run, calls = failing("SIGSEGV", then=42)
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        once_more_if_a_spawned_worker_aborts_at_exit(run)
    assert len(calls) == 1
    run, calls = failing("SIGABRT")  # twice: fails
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        once_more_if_a_spawned_worker_aborts_at_exit(run)
    assert len(calls) == 2
