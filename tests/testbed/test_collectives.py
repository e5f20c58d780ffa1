"""The collective counter the benchmarks and the multi-rank tests share, on a real 2-rank gloo
group: calls per function name, kinds and the bytes each rank sends by the ring formula."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Each rank counts a real all-gather, reduce-scatter and all-reduce of 8 fp32 (32 bytes) each,
# an all-gather into a list of two 4-element tensors (FSDP1's on CPU), then one more all-reduce
# while paused.
WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
from testbed.collectives import CollectiveCounter

rank = int(sys.argv[1])
counter = CollectiveCounter()
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
out = {}
dist.all_gather_into_tensor(torch.zeros(8), torch.ones(4))
dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(8))
out["names"] = counter.take()
dist.all_reduce(torch.ones(8))
dist.all_gather_into_tensor(output_tensor=torch.zeros(8), input_tensor=torch.ones(4))
dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.ones(4))
with counter.paused():
    dist.all_reduce(torch.ones(8))
out["traffic"] = vars(counter.take_traffic())
out["after"] = counter.take()
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_counts_each_call_by_name_and_kind_with_ring_bytes(tmp_path):
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), store],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["names"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
        # On 2 ranks a rank sends half of each all-gather's output (16 bytes, the list's two tensors
        # together too) and twice half of the all-reduce's tensor (32 bytes); the paused all-reduce
        # is not counted.
        assert out["traffic"] == {"reduce_scatters": 0, "all_reduces": 1, "all_gathers": 2, "bytes_sent": 64.0}
        assert out["after"] == {}
