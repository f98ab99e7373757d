"""A converted two-layer nn.TransformerEncoder trained under DistributedDataParallel (gloo, two processes on
localhost) gets the gradients of a single-process run on the same data."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnx
from dispatch_helpers import DispatchRecorder

E, HEADS, FF, LAYERS = 16, 2, 32, 2
BATCH, LENGTH, WORLD = 4, 7, 2

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.0, batch_first=True, dtype=torch.float64)
    return attnx.convert(torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, LENGTH, E, dtype=torch.float64, generator=g)
    target = torch.randn(BATCH, LENGTH, E, dtype=torch.float64, generator=g)
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    padding[1, -2:] = True
    padding[3, -4:] = True
    return x, target, padding


def _loss(model, x, target, padding):
    return torch.nn.functional.mse_loss(model(x, src_key_padding_mask=padding), target)


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model().train())
        x, target, padding = _data()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        _loss(model, x[shard], target[shard], padding[shard]).backward()  # DDP averages the shards' gradients
        if rank == 0:
            torch.save({name: p.grad for name, p in model.module.named_parameters()},
                       os.path.join(out_dir, "grads.pt"))
        # Leave together: no rank may leave while the other is still in the backward's last collectives or,
        # as rank 0 here, still saving.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Both ranks are done communicating. Tearing the group down (gloo's connections, its worker and event-loop
    # threads, and on rank 0 the TCPStore server) can still abort the rank that gets there first, "terminate
    # called without an active exception" (SIGABRT), on a loaded machine, even after the barrier: the process
    # ends here, so it ends without that teardown.
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gradients_match_a_single_process(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ddp_grads = torch.load(tmp_path / "grads.pt")

    model = _model().train()
    _loss(model, *_data()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads.keys() == ddp_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(
            ddp_grads[name], grad, atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_converted_layers_run_attnx():
    """The comparison above is about attnx only if the converted layers run attnx's fused forward and
    backward."""
    model = _model().train()
    x, target, padding = _data()
    with DispatchRecorder() as recorder:
        _loss(model, x, target, padding).backward()
    assert (
        recorder.counts["attnx::mha_forward"] == LAYERS and recorder.counts["attnx::mha_backward"] == LAYERS
    )
