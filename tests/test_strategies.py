"""Lightning strategies: which ones the regularizer callbacks accept at ``setup`` (pinned messages), and a
real ``ModelParallelStrategy`` (FSDP2) run on 2 CPU processes (gloo, float64) against the unsharded
network under DDP.

Lightning's ``FSDPStrategy`` refuses CPU, so its run needs a GPU machine and is not part of CI; the
mechanism below Lightning (an FSDP1-wrapped network) is tested on CPU in ``test_fsdp.py``.
"""
from __future__ import annotations

import copy
import datetime
import os
import sys
import socket
import warnings

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from jvpreg.callbacks import JacobianRegularizer, ParameterSensitivityRegularizer, TangentPropRegularizer
from jvpreg.callbacks.strategies import check_strategy, has_weight_directions
from jvpreg.losses import JacobianFrobenius, ParameterSensitivity, regularized_forward

LAM = 0.25


def _fake(name: str):
    return type(name, (), {})()


@pytest.mark.parametrize("name,match", [
    ("DeepSpeedStrategy", r"not implemented for DeepSpeedStrategy\. DeepSpeed partitions .* Use "
                          r"strategy=ModelParallelStrategy\(\) with fully_shard in configure_model"),
    ("XLAFSDPStrategy", r"not implemented for XLAFSDPStrategy\. XLA's FSDP is not supported"),
], ids=["deepspeed", "xla_fsdp"])
def test_refused_strategies_fail_at_setup(name, match):
    from test_callbacks import Lit, mlp_dropout
    trainer = type("T", (), {"strategy": _fake(name), "callbacks": []})()
    with pytest.raises(NotImplementedError, match=r"JacobianRegularizer\(name='jacobian_frobenius'\): " + match):
        JacobianRegularizer(1.0).setup(trainer, Lit(mlp_dropout()), "fit")


def test_fsdp1_refuses_weight_directions_only():
    from test_callbacks import Lit, mlp_dropout
    trainer = type("T", (), {"strategy": _fake("FSDPStrategy"), "callbacks": []})()
    JacobianRegularizer(1.0).setup(trainer, Lit(mlp_dropout()), "fit")  # input directions: accepted
    with pytest.raises(NotImplementedError, match=r"weight-space directions \(ParameterSensitivity\) are not "
                                                  r"implemented for FSDPStrategy .* Use strategy=ModelParallel"):
        ParameterSensitivityRegularizer(1.0, params="*weight").setup(trainer, Lit(mlp_dropout()), "fit")
    for name in ("ModelParallelStrategy", "DDPStrategy", "SingleDeviceStrategy"):
        check_strategy(_fake(name), [(ParameterSensitivity(), 1.0, 1.0)], "where")
    assert has_weight_directions(ParameterSensitivity()) and not has_weight_directions(JacobianFrobenius())


# --------------------------------------------------------------------------- ModelParallelStrategy on CPU


class ShardedLit(pl.LightningModule):
    """An ordinary classifier that shards its network with FSDP2 in ``configure_model``."""

    def __init__(self, net: nn.Module, dataset=None):
        super().__init__()
        self.net, self.dataset = net, dataset

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)  # nested: the BatchNorm block, then the rest
        fully_shard(self.net, mesh=mesh)

    def train_dataloader(self):  # rank r gets samples r, r + 2, ... in order
        sampler = torch.utils.data.DistributedSampler(self.dataset, num_replicas=2, rank=self.global_rank,
                                                      shuffle=False)
        return torch.utils.data.DataLoader(self.dataset, batch_size=4, sampler=sampler)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def net_bn():
    return nn.Sequential(nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU()),
                         nn.Flatten(), nn.Linear(48, 3))


def callbacks():
    return [JacobianRegularizer(LAM, seed=0, module="net"), TangentPropRegularizer(LAM, "rotate", module="net"),
            ParameterSensitivityRegularizer(LAM, params="*weight", seed=1, module="net")]


def _model_parallel_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # processes "launched externally", as by torchrun
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from pytorch_lightning.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    net = net_bn().double()  # float64 throughout ("64-true" is refused by ModelParallelStrategy; "32-true"
    # leaves the module's dtype alone)
    g = torch.Generator().manual_seed(100)
    x = torch.randn(16, 1, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g)
    cbs = callbacks()
    penalties = [[copy.deepcopy(c.penalty) for c in cbs] for _ in range(2)]  # one generator state per rank
    model = ShardedLit(copy.deepcopy(net), torch.utils.data.TensorDataset(x, y))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, callbacks=cbs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)

    sim = copy.deepcopy(net)  # DDP: each rank's loss, gradients averaged, BatchNorm statistics per rank
    buffers = [[b.clone() for b in sim.buffers()] for _ in range(2)]
    opt = torch.optim.SGD(sim.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        for r in range(2):
            with torch.no_grad():
                for b, saved in zip(sim.buffers(), buffers[r]):
                    b.copy_(saved)
            idx = torch.arange(r, 16, 2)[4 * step:4 * step + 4]
            out, pen = regularized_forward(sim, x[idx], penalties[r])
            ((F.cross_entropy(out, y[idx]) + LAM * pen) / 2).backward()
            buffers[r] = [b.clone() for b in sim.buffers()]
        opt.step()
    assert all(c.steps_applied == 2 for c in cbs)
    for (n, a), b in zip(model.net.named_parameters(), sim.parameters()):
        torch.testing.assert_close(a.full_tensor(), b, rtol=1e-10, atol=1e-10, msg=lambda m: f"rank {rank} {n}: {m}")
    for (n, a), b in zip(model.net.named_buffers(), buffers[rank]):  # BN statistics of this rank's rows
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"rank {rank} {n}: {m}")
    dist.barrier()
    dist.destroy_process_group()
    # no interpreter teardown: under load a thread left at exit can abort a worker whose work is done
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_model_parallel_strategy_fsdp2_cpu_matches_ddp_simulation():
    """Three regularizers (input and weight directions) under ModelParallelStrategy + fully_shard."""
    pytest.importorskip("torch.distributed.fsdp").fully_shard
    mp.spawn(_model_parallel_worker, args=(_free_port(),), nprocs=2, join=True)


# --------------------------------------------------------------------------- the app: trainer=fsdp


def test_fsdp2_strategy_sizes_and_errors():
    from pytorch_lightning.strategies import ModelParallelStrategy

    from jvpreg.callbacks.strategies import fsdp2_strategy

    s = fsdp2_strategy(4, 2)
    assert isinstance(s, ModelParallelStrategy)
    assert (s._data_parallel_size, s._tensor_parallel_size, s._save_distributed_checkpoint) == (8, 1, False)
    with pytest.raises(ValueError, match=r"fsdp2_strategy\(devices, num_nodes\): expected devices to be an int >= 1 "
                                         r"\(the count, not 'auto' or a list\), got 'auto'\."):
        fsdp2_strategy("auto")


def test_trainer_fsdp_config_composes_to_fsdp2():
    from test_configs import make_cfg
    from hydra.utils import instantiate

    cfg = make_cfg(["trainer=fsdp", "trainer.accelerator=cpu", "trainer.num_nodes=1"])
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ == "ModelParallelStrategy"
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_app_trains_with_trainer_fsdp_on_two_cpu_processes(tmp_path):
    """``jvpreg-train trainer=fsdp`` end to end (2 processes, Lightning's own launcher): FSDP2 groups
    from ``ImageClassifier.configure_model``, two regularizers, test, robustness on rank 0."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jvpreg.train", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
           "logger=csv", "regularizer=stacked", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
           "trainer.limit_val_batches=2", "robustness.max_samples=32", "robustness.jacobian_max_samples=8",
           "robustness.pgd_steps=1", "num_threads=1", f"hydra.run.dir={out}", f"paths.output_dir={out}"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stdout + proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert "test/acc" in metrics and "robustness/clean_acc" in metrics
    assert (out / "checkpoints" / "best.ckpt").is_file()


# --------------------------------------------------------------------------- FSDPStrategy (GPU only)


class PlainLit(ShardedLit):
    """The same classifier without configure_model: FSDPStrategy wraps it itself."""

    configure_model = pl.LightningModule.configure_model


def _fsdp1_gpu_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    warnings.simplefilter("ignore")
    from pytorch_lightning.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    net = net_bn().double()
    g = torch.Generator().manual_seed(100)
    x = torch.randn(16, 1, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g)
    cbs = callbacks()[:2]  # input directions only under FSDP1
    penalties = [[copy.deepcopy(c.penalty) for c in cbs] for _ in range(2)]
    model = PlainLit(copy.deepcopy(net), torch.utils.data.TensorDataset(x, y))
    strategy = FSDPStrategy(auto_wrap_policy={nn.Conv2d, nn.Linear}, timeout=datetime.timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="gpu", devices=2, strategy=strategy, max_steps=2, callbacks=cbs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)
    sim = copy.deepcopy(net)
    opt = torch.optim.SGD(sim.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        for r in range(2):
            idx = torch.arange(r, 16, 2)[4 * step:4 * step + 4]
            out, pen = regularized_forward(sim, x[idx], penalties[r])
            ((F.cross_entropy(out, y[idx]) + LAM * pen) / 2).backward()
        opt.step()
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
        for (n, a), b in zip(model.net.named_parameters(), sim.parameters()):
            torch.testing.assert_close(a.detach().cpu(), b, rtol=1e-8, atol=1e-8, msg=lambda m: f"rank {rank} {n}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Lightning's FSDPStrategy needs 2 GPUs")
def test_fsdp_strategy_gpu_input_directions_match_ddp_simulation():
    """FSDP1 through Lightning (GPU only): JacobianRegularizer + TangentPropRegularizer, float64."""
    mp.spawn(_fsdp1_gpu_worker, args=(_free_port(),), nprocs=2, join=True)


def test_jacobian_monitor_refuses_sharded_strategies():
    from test_callbacks import Lit, mlp_dropout

    from jvpreg.callbacks import JacobianMonitor

    trainer = type("T", (), {"strategy": _fake("ModelParallelStrategy"), "callbacks": [], "limit_val_batches": 1})()
    with pytest.raises(NotImplementedError, match=r"JacobianMonitor: not implemented for ModelParallelStrategy: the "
                                                  r"power iteration stops after a data-dependent number of forwards"):
        JacobianMonitor().setup(trainer, Lit(mlp_dropout()), "fit")


_AT_EXIT_SCRIPT = r"""
import atexit, sys, tempfile, os
import torch.distributed as dist
from jvpreg.callbacks.strategies import destroy_process_group_at_exit, _AT_EXIT
destroy_process_group_at_exit()  # no group yet: nothing registered
print("registered without a group:", _AT_EXIT[0])
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0, world_size=1)
atexit.register(lambda: print("group alive after the handler:", dist.is_initialized(), flush=True))  # runs last
destroy_process_group_at_exit()
destroy_process_group_at_exit()  # once per process
print("registered:", _AT_EXIT[0], flush=True)
"""


_END_WORKER_SCRIPT = r"""
import atexit, os, sys
import torch.distributed as dist
from jvpreg.callbacks.strategies import end_worker_process
rank, path = int(sys.argv[1]), sys.argv[2]
end_worker_process()  # no group: nothing
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
atexit.register(lambda: print("teardown ran", flush=True))
print("rank", rank, "done", flush=True)
dist.barrier()
end_worker_process()
print("rank", rank, "after end_worker_process", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_finished_worker_rank_ends_without_interpreter_teardown(tmp_path):
    """The app's worker ranks end with ``os._exit(0)`` once their work is done (their output flushed), rank 0
    goes on: the gloo abort in a worker's teardown cannot fail a finished run."""
    import subprocess

    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _END_WORKER_SCRIPT, str(r), store], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert outs[0][0].splitlines() == ["rank 0 done", "rank 0 after end_worker_process", "teardown ran"]
    assert outs[1][0].splitlines() == ["rank 1 done"]


@pytest.mark.slow
def test_the_process_group_is_destroyed_at_exit_while_python_is_alive():
    """Lightning leaves the group to the interpreter's teardown, where a gloo worker can abort after its work is
    done; the callbacks' setup registers one exit handler that destroys it first."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _AT_EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["registered without a group: False", "registered: True", "group alive after the handler: False"]
