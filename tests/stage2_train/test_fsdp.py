"""The FSDP settings of `dflash train --fsdp` (dflash.stage2_train.run_setup.fsdp_plugin) on the real drafter.

Accelerate has no FSDP on CPU, so the test wraps the drafter with torch's FSDP itself, the way Accelerate's plugin
asks for (auto-wrap policy, original parameters), in two gloo processes that really shard it, and checks one
optimizer step against the same step on one unsharded drafter. The optimizer is built before wrapping, as the
trainer builds it before `accelerator.prepare`: with FSDP's flat parameters (use_orig_params=False) it would hold
parameters FSDP no longer uses, and the step would change nothing.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.modeling_dflash import DFlashDecoderLayer, DFlashDraftModel
from dflash.stage2_train.run_setup import fsdp_plugin

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=100, block_size=4, num_target_layers=4,
              dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 2]})


def _drafter_and_optimizer() -> tuple[DFlashDraftModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = training_drafter(DFlashConfig(**CONFIG), "sdpa")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return (torch.randn(1, 8, 64, generator=generator), torch.randn(1, 12, 128, generator=generator),
            torch.arange(12, 20)[None])


def _sharded_step(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, optimizer = _drafter_and_optimizer()
    plugin = fsdp_plugin("no")
    plugin.set_auto_wrap_policy(model)
    sharded = FSDP(model, auto_wrap_policy=plugin.auto_wrap_policy, use_orig_params=plugin.use_orig_params,
                   device_id=torch.device("cpu"))
    assert sum(isinstance(m, FSDP) for m in sharded.modules()) == 1 + CONFIG["num_hidden_layers"]
    sharded(*_inputs(rank)).square().mean().backward()
    optimizer.step()
    # offload_to_cpu=False: on a CPU-only process group the offloading copy crashes torch 2.13's gather.
    with FSDP.state_dict_type(sharded, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True, offload_to_cpu=False)):
        state = sharded.state_dict()
    if rank == 0:
        torch.save(state, out)
    # Every rank's gloo work has finished before either tears the group down: one CI run had rank 1 abort
    # ("terminate called without an active exception") when it left while rank 0 was still saving.
    del sharded, state
    dist.barrier()
    dist.destroy_process_group()


def test_plugin_pins_the_settings_training_and_export_rely_on() -> None:
    from torch.distributed.fsdp import StateDictType

    bf16, fp32 = fsdp_plugin("bf16"), fsdp_plugin("no")
    for plugin in (bf16, fp32):
        assert plugin.fsdp_version == 1 and plugin.use_orig_params
        assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT  # export --run reads pytorch_model_fsdp.bin
        assert plugin.transformer_cls_names_to_wrap == [DFlashDecoderLayer.__name__]
    policy = bf16.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == (
        torch.bfloat16, torch.float32, torch.float32)  # RoPE inv_freq stays float32
    assert fp32.mixed_precision_policy is None


def test_two_sharded_processes_take_the_same_step_as_one_whole_drafter(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "state.pt"
    mp.spawn(_sharded_step, args=(2, port, str(out)), nprocs=2)

    model, optimizer = _drafter_and_optimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # FSDP averages the two ranks' gradients: the same step is the mean of their losses.
    ((model(*_inputs(0)).square().mean() + model(*_inputs(1)).square().mean()) / 2).backward()
    optimizer.step()
    sharded = torch.load(out, weights_only=True)
    assert sorted(sharded) == sorted(model.state_dict())  # plain names, as export and `export --run` expect
    moved = max(float((sharded[k] - before[k]).abs().max()) for k in sharded)
    assert moved > 1e-3  # the optimizer updated the weights FSDP trains
    for key, value in model.state_dict().items():
        torch.testing.assert_close(sharded[key], value, rtol=1e-5, atol=1e-6, msg=key)
