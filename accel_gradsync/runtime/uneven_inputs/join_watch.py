"""Which forwards inside `join()` (join.py) are the loop's: a forward pre-hook on each FSDP model
the attach bound, ahead of FSDP's own, and torch's global forward pre-hook for DDP's wrapper,
which accelerate does not list and whose forward may issue collectives (buffers, bucket rebuilds)
before its module's. Each forward reaches the sink once, at its start, with the module to replay
(a DDP model's wrapper) and the inputs as the module got them (the global hook gets no kwargs, so
the wrapper's module, hooked on first sight, hands them over).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.utils.hooks
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel


class ForwardSink(Protocol):
    def start(self, module: nn.Module) -> None:
        """A watched forward begins, before any collective of its own."""

    def record(self, called: nn.Module, args: tuple, kwargs: dict) -> None:
        """Its call, to replay: `called` with `args` and `kwargs`."""


class ForwardWatch:
    """The hooks of one `join()` block, on the models of `adapters` (by root) and DDP wrappers."""

    def __init__(self, sink: ForwardSink) -> None:
        self.sink = sink
        self._hooks: dict[nn.Module, torch.utils.hooks.RemovableHandle] = {}
        self._global: torch.utils.hooks.RemovableHandle | None = None
        self._ddp_call: tuple[nn.Module, nn.Module] | None = None  # (module, its DDP wrapper) under way

    def watch(self, adapters: dict[nn.Module, Any]) -> None:
        """Hook every FSDP model of `adapters` not hooked yet (a model bound since), and DDP's."""
        if self._global is None:
            self._global = register_module_forward_pre_hook(self._any_forward)
        for root, adapter in adapters.items():
            if adapter is not None and adapter.kind != "ddp" and root not in self._hooks:
                self._hook(root)

    def close(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        if self._global is not None:
            self._global.remove()
            self._global = None
        self._ddp_call = None

    def _hook(self, module: nn.Module) -> None:
        self._hooks[module] = module.register_forward_pre_hook(self._forward, prepend=True, with_kwargs=True)

    def _any_forward(self, module: nn.Module, args: tuple) -> None:
        if not isinstance(module, DistributedDataParallel):
            return
        inner = module.module
        if inner not in self._hooks:
            self._hook(inner)
        self.sink.start(module)
        self._ddp_call = (inner, module)

    def _forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._ddp_call is not None and self._ddp_call[0] is module:
            called, self._ddp_call = self._ddp_call[1], None  # replayed through its wrapper
        else:
            called = module
            self.sink.start(module)
        self.sink.record(called, args, kwargs)
