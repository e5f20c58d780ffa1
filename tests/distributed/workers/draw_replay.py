"""`catch_up` (runtime/generating/draw_replay.py) on 2 gloo ranks under torchrun, without a model or
transformers: rank 0's generation ran 3 forwards, rank 1's ran 7, each forward drawing a dropout mask
the size of one token's activations (as PEFT's dropout does). Per value of `--ahead`, rank 1 calls
`catch_up` only once rank 0 has replayed that many forwards past its end (each replay writes its
count to a file rank 1 reads), so rank 0 runs ahead of the answer by a known amount: 0 (the answer
comes first), 5 (back to a state it kept), 20 (further than it keeps: from the start again). Each
replay sleeps 5 ms, so rank 0 gets few replays further before it has the answer. Per value each rank
reports its CPU generator's fingerprint after `catch_up`, the fingerprint after exactly the replays
it is short from the same start (4 for rank 0, none for rank 1), and how many replays it ran."""

import hashlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import parse_args, write_result
from torch import nn

from accel_gradsync.runtime.generating.draw_replay import ForwardsSeen, catch_up, replay_token

FORWARDS = (3, 7)


class Drop(nn.Module):
    """A forward that draws what a decoded token's LoRA dropout draws, and writes how many it ran."""

    def __init__(self, count_file: Path) -> None:
        super().__init__()
        self.count_file, self.calls = count_file, 0

    def forward(self, input_ids: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        self.calls += 1
        self.count_file.write_text(str(self.calls))
        time.sleep(0.005)
        return nn.functional.dropout(torch.ones(input_ids.shape[0], 1, 16), 0.5, training=True)


def fingerprint() -> str:
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


args = parse_args([(("--ahead",), {"type": int, "nargs": "+", "required": True}), (("--tmp",), {"required": True})])
dist.init_process_group("gloo")
rank = dist.get_rank()
replays = Path(args.tmp) / f"rank{rank}_replays"
model = Drop(replays)
seen = ForwardsSeen()
for _ in range(FORWARDS[rank]):  # the generation's forwards, as generate's loop calls them
    seen.see((), {"input_ids": torch.ones(2, 5, dtype=torch.long)})
out = {}
for ahead in args.ahead:
    torch.manual_seed(rank)
    start = torch.get_rng_state()
    for _ in range(max(FORWARDS) - FORWARDS[rank]):
        replay_token(model, seen.last)
    expected = fingerprint()
    torch.set_rng_state(start)
    model.calls = 0
    replays.write_text("0")
    dist.barrier()
    if rank == 1:  # let rank 0 replay `ahead` forwards before the answer can come
        while int((Path(args.tmp) / "rank0_replays").read_text() or 0) < ahead:
            time.sleep(0.001)
    catch_up(model, seen, None)
    out[str(ahead)] = {"expected": expected, "got": fingerprint(), "replays": model.calls}
    dist.barrier()
write_result(args.out, out)
