"""A model transformers shards at load time (`DistributedConfig`), trained in accelerate's loop
without `accumulate()` (`no_sync` around the held micro-batches) with an evaluation forward after
every optimizer step: what the handle counted against the collectives counted from outside over
the whole loop, evaluations included."""

import json
import os
import warnings

import torch
from accelerate import Accelerator
from common import CollectiveCounter, parse_args, write_result
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import accel_gradsync
from testbed.collectives import KIND

args = parse_args(
    [
        (("--model",), {"required": True}),
        # [{"name": ..., "config": GradSyncConfig kwargs}, ...]
        (("--runs",), {"type": json.loads, "required": True}),
        (("--M",), {"type": int, "default": 2}),
        (("--steps",), {"type": int, "default": 3}),
    ]
)
counter = CollectiveCounter()
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
SEQ, BATCH = 8, 2


def batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i * world + rank)
    return torch.randint(0, 64, (BATCH, SEQ), generator=g)


results = {}
for run in args.runs:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(fsdp_size=world))
    accelerator = Accelerator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
        handle.bind(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    counter.take()
    before = handle.stats()
    for i in range(args.M * args.steps):
        ids = batch(i)
        if (i + 1) % args.M:
            with accelerator.no_sync(model):
                accelerator.backward(model(input_ids=ids, labels=ids).loss / args.M)
            continue
        accelerator.backward(model(input_ids=ids, labels=ids).loss / args.M)
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():  # an evaluation between optimizer steps
            model(input_ids=batch(1000 + i), labels=batch(1000 + i))
        model.train()
    ran: dict = {}
    for name, calls in counter.take().items():
        ran[KIND[name]] = ran.get(KIND[name], 0) + calls
    stats = handle.stats()
    handle.detach()
    keys = ("all_gathers", "generation_all_gathers", "reduce_scatters_issued", "micro_batches", "optimizer_steps")
    results[run["name"]] = {"ran": ran, "counted": {k: stats[k] - before[k] for k in keys}}

write_result(args.out, {"runs": results})
