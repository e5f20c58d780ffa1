"""Misuse that `attach` must refuse before any training step, on 2 ranks under an FSDP config.
`--case no_enable` skips `enable_cpu_fsdp()` (accelerate then silently runs N lone processes);
`--case misuse` runs the other refusals one after the other; `--case modes` asks for modes the
wrapper cannot run; `--case unwrapped` (torchrun, DDP) binds a model accelerate left unwrapped,
which gets a warning, not a refusal. Each message is reported."""

import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from common import DIM, TinyNet, parse_args, write_result

import accel_gradsync

args = parse_args([(("--case",), {"required": True})])


def refusal(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


result = {}
if args.case == "no_enable":  # under an FSDP2 config
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = TinyNet()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result["no_enable"] = refusal(lambda: accel_gradsync.attach(accelerator))
elif args.case == "modes":  # modes the wrapper cannot run, under FSDP1 or a 1-D FSDP2 mesh
    accel_gradsync.enable_cpu_fsdp()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = TinyNet()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for mode, extra in (("budget", {"memory_budget": "1GiB"}), ("defer_all_reduce", {})):
        config = accel_gradsync.GradSyncConfig(sync_mode=mode, **extra)
        result[mode] = refusal(lambda config=config: accel_gradsync.attach(accelerator, config).detach())
elif args.case == "unwrapped":  # under torchrun: accelerate's DDP
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = TinyNet()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(defer=True))
    plain = TinyNet()  # never prepared: no wrapper, no gradient sync
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["bind"] = repr(handle.bind(plain))
        result["bind_again"] = repr(handle.bind(plain))
        with accelerator.accumulate(plain):  # accelerate's own no_sync applies
            accelerator.backward(plain(torch.ones(2, DIM)).sum())
    result["warnings"] = [
        {"category": w.category.__name__, "message": str(w.message), "file": w.filename} for w in caught
    ]
    result["worker_file"] = __file__
    result["grad"] = plain.head.weight.grad is not None
    handle.detach()
else:  # "misuse", under FSDP2
    accel_gradsync.enable_cpu_fsdp()
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    # The Trainer prepares a model sharded at load time like this: accelerate does not wrap it.
    unwrapped = accelerator.prepare_model(TinyNet(), evaluation_mode=True)
    result["not_wrapped"] = refusal(lambda: accel_gradsync.attach(accelerator))
    accelerator.free_memory()
    model = TinyNet()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result["sync_each_batch"] = refusal(
        lambda: accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(defer=True))
    )
    handle = accel_gradsync.attach(accelerator)  # per-micro-batch agrees with sync_each_batch
    result["attach_twice"] = refusal(lambda: accel_gradsync.attach(accelerator))
    result["not_a_target"] = refusal(lambda: accel_gradsync.attach(model))
    handle.detach()
    result["class_after_detach"] = type(accelerator).__name__
write_result(args.out, result)
