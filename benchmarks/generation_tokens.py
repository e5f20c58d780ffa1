"""Generation's time per decoded token with every FSDP2 unit kept unsharded, against the same model
with no FSDP at all (the floor): `python -m benchmarks.generation_tokens [--ranks 2] [--profile]`.

Each rank builds the GRPO benchmark's random-weight Qwen2 (`grpo.SIZES`), keeps a plain copy (the
floor) and prepares the other with accelerate's FSDP2 (decoder layers as units), the plugin
attached. Rows, interleaved in a rotating order every repetition, each a greedy
`model.generate(...)` of `--tokens` tokens under `torch.no_grad()`:

- `floor`: the plain copy; no FSDP, no hooks.
- `fsdp_hooks_on`: every unit kept unsharded by its FSDP2 flag (`set_reshard_after_forward(False)`
  through the plugin's adapter, what generation did before it skipped FSDP2's idle per-forward
  work): FSDP2 runs its pre- and post-forward on every unit at every token, with nothing to gather.
- `fsdp_skipped`: the same, with FSDP2's idle per-forward work skipped
  (`runtime/wrappers/quiet_generation.py`'s `skip_idle_forward_work`).
- `plugin`: inside `grad_sync.gathered(model)`, what `gather_for_generation` runs: the kept units,
  FSDP2's idle work skipped, and the plugin's own hooks (its live counters among them).
- `stock` (`--stock`): FSDP2 as accelerate leaves it, an all-gather per unit per token.

A logits processor stamps the time at every generated token; a row's time per token is the median
of the intervals between stamps (decode steps only: the prefill and its all-gathers excluded), wall
and this process's CPU time. Every row must generate the same tokens (under `--mixed-precision
bf16` the floor, whose buffers are cast too, only its own every time). The driver prints, per row,
the median over repetitions and its spread, and the ratio to the floor (median of the per-repetition
ratios, which cancels the machine's load in that repetition). `--profile`: cProfile of one
generation per row (rank 0's printed), FSDP2's and the plugin's functions per token.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--ranks", type=int, default=2, help="gloo ranks (FSDP2's shard size)")
    add("--size", default="full", help="a model size of benchmarks/grpo.py's SIZES")
    add("--tokens", type=int, default=32, help="tokens generated per row and repetition")
    add("--batch", type=int, default=4, help="sequences generated together (GRPO: its generations)")
    add("--prompt", type=int, default=16, help="prompt tokens")
    add("--reps", type=int, default=7, help="interleaved repetitions of every row")
    add("--stock", action="store_true", help="add FSDP2 without keeping (an all-gather per unit per token)")
    add("--mixed-precision", default="no", choices=["no", "bf16"], help="accelerate's mixed precision")
    add("--profile", action="store_true", help="cProfile one generation per row (rank 0's printed)")
    add("--timeout", type=int, default=900, help="seconds for the launch")
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return work(args)
    from benchmarks import grpo
    from testbed.launch import fsdp2_config, launch

    config = {**fsdp2_config(grpo.LAYER_CLASS, args.ranks), "mixed_precision": args.mixed_precision}
    env = {"CUDA_VISIBLE_DEVICES": "", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    worker = ["--worker", *(sys.argv[1:] if argv is None else argv)]  # the same flags, on every rank
    done = launch(Path(__file__), worker, config, env=env, timeout=args.timeout)
    print(report(done.check("generation_tokens' workers", args.ranks), args))
    return 0


def report(ranks: list[dict], args: argparse.Namespace) -> str:
    """Per row: ms per token (wall and CPU), median over repetitions [min, max], and the median of the
    per-repetition ratios to the floor, on each rank; then rank 0's profile."""
    first = ranks[0]
    lines = [
        f"generation, {args.ranks} gloo ranks, {first['model']}: {args.batch} sequences x {args.tokens} tokens, "
        f"{args.reps} interleaved repetitions; ms per decoded token (median [min, max]), ratio to the floor",
        f"{'rank':>4} {'row':<14} {'wall ms':>22} {'x floor':>8} {'cpu ms':>22} {'x floor':>8}",
    ]
    for r, rank in enumerate(ranks):
        for row, reps in rank["rows"].items():
            cells = []
            for key in ("wall", "cpu"):
                values = [rep[key] for rep in reps]
                floor = [rep[key] for rep in rank["rows"]["floor"]]
                ratio = statistics.median(v / f for v, f in zip(values, floor, strict=True))
                cells.append(f"{statistics.median(values):7.3f} [{min(values):6.3f}, {max(values):6.3f}] {ratio:8.3f}")
            lines.append(f"{r:>4} {row:<14} {cells[0]} {cells[1]}")
    for row, text in first.get("profile", {}).items():
        lines += ["", f"rank 0, {row}: cProfile of one generation, per decoded token (cProfile inflates Python)", text]
    return "\n".join(lines)


# -- the worker (one rank) -------------------------------------------------------------------------


class Stamps:
    """A logits processor that records the wall and CPU time at every generated token, and profiles
    the decode steps (`profile`: enabled at the first token, after the prefill and its all-gathers)."""

    def __init__(self, profile: cProfile.Profile | None = None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.profile = profile

    def __call__(self, input_ids, scores):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self.profile is not None and len(self.wall) == 1:
            self.profile.enable()
        return scores

    def per_token_ms(self) -> dict[str, float]:
        def gaps(t: list[float]) -> float:
            return 1e3 * statistics.median(b - a for a, b in zip(t, t[1:], strict=False))

        return {"wall": gaps(self.wall), "cpu": gaps(self.cpu)}


def work(args: argparse.Namespace) -> int:
    import torch
    from accelerate import Accelerator
    from transformers import LogitsProcessorList, Qwen2ForCausalLM

    import accel_gradsync
    from accel_gradsync.runtime.wrappers.adapt import adapt_model
    from accel_gradsync.runtime.wrappers.quiet_generation import skip_idle_forward_work
    from benchmarks import grpo
    from benchmarks.measure import attach, write_rank

    accel_gradsync.enable_cpu_fsdp()
    torch.set_num_threads(1)
    accelerator = Accelerator()
    config = grpo.qwen2_config(grpo.SIZES[args.size], args.prompt + args.tokens + 8, pad=0, eos=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    floor = copy.deepcopy(model).eval()
    if args.mixed_precision == "bf16":
        floor = floor.to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # accelerate's FSDP2 prepares a model with one
    model, _ = accelerator.prepare(model, optimizer)
    model.eval()
    grad_sync = attach(accelerator, {})
    ids = torch.randint(2, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    adapter = adapt_model(model)
    assert adapter is not None

    @contextlib.contextmanager
    def fsdp_hooks_on():
        """Every unit kept unsharded by its FSDP2 flag (the plugin's adapter sets it, as generation
        did before skipping FSDP2's idle work), then the flags put back and the units resharded."""
        restore = adapter.keep_params_through_forward(adapter.units)
        try:
            yield
        finally:
            restore()
            adapter.reshard_unless_kept(adapter.units)

    @contextlib.contextmanager
    def fsdp_skipped():
        """The same, with FSDP2's idle forward work skipped (runtime/wrappers/quiet_generation.py)."""
        with fsdp_hooks_on():
            restore = skip_idle_forward_work(adapter, adapter.units)
            try:
                yield
            finally:
                restore()

    rows = {
        "floor": (floor, contextlib.nullcontext),
        "fsdp_hooks_on": (model, fsdp_hooks_on),
        "fsdp_skipped": (model, fsdp_skipped),
        "plugin": (model, lambda: grad_sync.gathered(model)),
    }
    if args.stock:
        rows["stock"] = (model, contextlib.nullcontext)

    def generate(name: str, profile: cProfile.Profile | None = None) -> tuple[dict, list]:
        module, around = rows[name]
        stamps = Stamps(profile)
        with torch.no_grad(), around():
            out = module.generate(
                ids,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([stamps]),
            )
            if profile is not None:
                profile.disable()
        return stamps.per_token_ms(), out.tolist()

    generate("plugin")  # FSDP2's lazy init and first all-gathers, off the clock
    results: dict[str, list[dict]] = {name: [] for name in rows}
    # Every row generates the same tokens; under bf16 the floor (its buffers cast too) only its own.
    references: dict[str, list] = {}
    names = list(rows)
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            timing, tokens = generate(name)
            reference = references.setdefault(
                "floor" if name == "floor" and args.mixed_precision != "no" else "", tokens
            )
            if tokens != reference:
                raise AssertionError(f"{name} generated other tokens than an earlier row")
            results[name].append(timing)
    out = {"model": f"Qwen2 {args.size} ({sum(p.numel() for p in floor.parameters()) / 1e6:.2f} M params)"}
    out["rows"] = results
    if args.profile:  # every rank: a row's first token all-gathers
        profiles = {name: profiled(lambda p, n=name: generate(n, p), args.tokens) for name in rows}
        if accelerator.process_index == 0:
            out["profile"] = profiles
    write_rank(args.out, accelerator.process_index, out)
    return 0


def profiled(run, tokens: int) -> str:
    """cProfile of `run(profile)`'s decode steps (`tokens` - 1): FSDP2's, the plugin's and
    nn.Module's `_call_impl` functions, per token."""
    profile = cProfile.Profile()
    run(profile)
    tokens -= 1  # the prefill's token is not profiled
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if "_fully_shard" in file or "accel_gradsync" in file or (func == "_call_impl" and "module.py" in file):
            figures = f"{calls / tokens:8.1f} {1e3 * tottime / tokens:9.3f} {1e3 * cumtime / tokens:9.3f}"
            rows.append((cumtime, f"{figures}  {Path(file).name}:{line}({func})"))
    rows.sort(reverse=True)
    head = f"total {1e3 * total / tokens:.3f} ms/token; calls/token, own ms/token, cumulative ms/token, function"
    return "\n".join([head, *(text for _, text in rows[:25])])


if __name__ == "__main__":
    sys.exit(main())
