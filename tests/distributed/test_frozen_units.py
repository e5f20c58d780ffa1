"""`keep_frozen_unsharded` (runtime/wrappers/frozen_units.py) on 2 gloo ranks under `accelerate launch`,
FSDP2 with decoder layers as units: a tiny Qwen2 with PEFT LoRA (r = 4 on q_proj and v_proj), the
optimizer built before `prepare` (workers/frozen_units.py).

- Each decoder layer's adapters get a unit of their own; the layer's unit keeps only frozen
  parameters, as do the root and the embeddings.
- All-gathers counted from outside: the first step gathers every unit, each later step only the
  adapter units, forward and backward of each micro-batch (they reshard after forward as the
  accelerate config says): the bytes of the adapters and nothing else.
- The losses and every final parameter equal the run without the setting, bit for bit; so they do
  with a base layer unfrozen after the first step (its unit reshards again from then on, and
  trains), and with the whole state dict taken between steps (FSDP2 reshards every unit for it:
  the next step gathers them again).
- So they do with a checkpoint saved before step 2 and loaded back before step 3, and with a
  forward that fails in the second decoder layer of step 2's last micro-batch (accumulate()
  discards the window's gradients, the reduced ones included, whatever each unit's state was
  when it failed).
- Merging the adapter between steps as TRL's vLLM weight sync does, after
  `grad_sync.reshard_frozen()`, reads the weights the run without the setting reads and trains on
  to the same parameters; the kept units are gathered once more. Without the call PEFT's merge
  raises. Called inside a window (between two micro-batches), the kept units are gathered once
  more and the run stays exact.
- A generation inside a step's first micro-batch (forwards without gradients, as TRL's), and an
  evaluation between steps, run none of FSDP2's own forward work on the kept units, under
  per_micro_batch (`true`) as under auto, and read stock's logits.
- Per-rank micro-batch counts every step (`grad_sync.step(n)`) end at the run padded to the
  largest count, bit for bit: under per_micro_batch the short rank replays (its all-gathers are
  the padded run's), under auto (adapters windowed) nothing is replayed and each step gathers
  each adapter unit once; the kept units are gathered at the first step alone.
- detach puts every unit back sharded; a model prepared before attach, FSDP1, and a Trainer
  whose arguments set TRL's `use_vllm` are refused in one line (under `use_vllm` auto keeps nothing;
  for a model prepared before attach, auto says in one line that it keeps nothing).
- On a 2x2 HSDP mesh (4 ranks, --slow): only the adapters are gathered after step 1, exact, merge included.
- TRL's GRPOTrainer through the recipe, `--use_peft` with `--beta` 0.04 (the reference is the policy
  with its adapter off; 0 too with --slow), TRL's default `lora_dropout` and activation checkpointing,
  deferred with the setting and windowed (the adapters gathered once, generation without
  transformers' per-token sync, LoRA's dropout replayed by a rank done first): the logged rewards
  equal the recipe's per-micro-batch run's at every step, its losses, KL and gradient norms up to
  summation order (1e-5 relative);
  every all-gather the ranks issued (counted from outside the recipe) is one the plugin's counters
  name, and the run issues fewer all-gathers and fewer all-reduces.
"""

import json

import pytest
from launcher import accelerate_config, launch
from test_grpo_recipe import run_command

M, STEPS, WORLD = 2, 3, 2
TOKENS = 4  # workers/frozen_units.py: generation forwards in a step that generates
UNEVEN = [[2, 1], [1, 3], [2, 2]]  # per step, each rank's micro-batches
LAYERS, HIDDEN, HEADS, KV_HEADS, R = 2, 32, 4, 2, 4  # workers/common.tiny_qwen2_config, LoraConfig(r=4)
HEAD_DIM = HIDDEN // HEADS
# One layer's adapters: q_proj (hidden -> hidden) and v_proj (hidden -> kv heads x head dim), A: r x in, B: out x r.
ADAPTER_NUMEL = (R * HIDDEN + HIDDEN * R) + (R * HIDDEN + KV_HEADS * HEAD_DIM * R)
CONFIG = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
KEEP = {"keep_frozen_unsharded": True}
BUDGET_ALL = {"sync_mode": "budget", "memory_budget": "1MiB"}  # auto keeps every frozen unit in it
FORECAST = {"forecast_micro_batch_size": 2, "forecast_seq_len": 8}  # workers/frozen_units.py's B and SEQ
RUNS = [
    {"name": "stock", "config": {}},
    {"name": "keep", "config": KEEP},
    {"name": "stock_unfreeze", "config": {}, "unfreeze_at": 1},
    {"name": "keep_unfreeze", "config": KEEP, "unfreeze_at": 1},
    {"name": "keep_state_dict", "config": KEEP, "state_dict_at": 1},
    {"name": "attach_after_prepare", "config": KEEP, "attach_after_prepare": True},
    {"name": "budget_after_prepare", "config": BUDGET_ALL, "attach_after_prepare": True},
    {"name": "stock_save_load", "config": {}, "save_at": 1, "load_at": 2},
    {"name": "keep_save_load", "config": KEEP, "save_at": 1, "load_at": 2},
    # The default, auto: budget keeps each frozen unit while it fits (all in 1 MiB; in 100 B no
    # decoder layer would fit, so nothing is split); per_micro_batch (the stock run) splits nothing.
    {"name": "budget_all", "config": BUDGET_ALL},
    {"name": "budget_none", "config": {"sync_mode": "budget", "memory_budget": "100B"}},
    {"name": "stock_raise", "config": {}, "raise_at": [1, 1]},
    {"name": "keep_raise", "config": KEEP, "raise_at": [1, 1]},
    {"name": "stock_merge", "config": {}, "merge_at": 1},
    {"name": "keep_merge", "config": KEEP, "merge_at": 1},
    {"name": "keep_merge_bare", "config": KEEP, "merge_at": 1, "reshard": False},
    # reshard_frozen() between two micro-batches of a step, under per_micro_batch and under auto.
    {"name": "keep_reshard_mid_window", "config": KEEP, "reshard_at": [1, 1]},
    {
        "name": "auto_reshard_mid_window",
        "config": {"sync_mode": "auto", "free_memory": "64MiB", **FORECAST},
        "reshard_at": [1, 1],
    },
    {"name": "vllm_keep", "config": KEEP, "use_vllm": True},
    {"name": "vllm_auto", "config": {"sync_mode": "budget", "memory_budget": "1MiB"}, "use_vllm": True},
    # auto planning step 1 from the whole-step forecast (runtime's units: the adapters split off).
    {"name": "auto_forecast", "config": {"sync_mode": "auto", "free_memory": "64MiB", **FORECAST}},
    # Generation inside the first micro-batch of step 2, as TRL's: the kept units' FSDP2 hooks idle.
    {"name": "stock_generate", "config": {}, "generate_at": 1},
    {"name": "keep_generate", "config": KEEP, "generate_at": 1},
    {"name": "auto_generate", "config": {"sync_mode": "auto", "free_memory": "64MiB", **FORECAST}, "generate_at": 1},
    # An evaluation (the same forwards, in eval mode) between steps 1 and 2, outside accumulate().
    {"name": "stock_evaluate", "config": {}, "evaluate_at": 1},
    {"name": "keep_evaluate", "config": KEEP, "evaluate_at": 1},
    # Per-rank counts every step (grad_sync.step(n)) against every rank padded to the largest.
    *(
        {"name": f"{name}_uneven{style}", "config": config, "counts": UNEVEN, "style": style or "step"}
        for name, config in (("keep", KEEP), ("auto", {"sync_mode": "auto", "free_memory": "64MiB", **FORECAST}))
        for style in ("", "/pad")
    ),
]


def frozen_units(rank: dict) -> int:
    """The `keep` run's FSDP2 units with no trainable parameter, read from FSDP2's own param groups
    (workers/frozen_units.units): the root (the final norm), each decoder layer's base, and the tied
    embeddings where accelerate gives them a unit of their own (accelerate 1.13's root holds them)."""
    return sum(1 for trained, _ in rank["runs"]["keep"]["units"].values() if trained == 0)


# What the compat tests read: each stack's suite (-m compat) launches these alone.
COMPAT_RUNS = (
    {"stock", "keep", "keep_merge_bare", "auto_generate"}
    | {
        f"{kind}_{what}"
        for kind in ("keep", "stock")
        for what in ("unfreeze", "save_load", "raise", "merge", "generate", "evaluate")
    }
    | {"keep_state_dict", "keep_reshard_mid_window"}
)


@pytest.fixture(scope="module")
def ranks(compat_only):
    runs = [run for run in RUNS if run["name"] in COMPAT_RUNS] if compat_only else RUNS
    return launch("frozen_units", ["--M", str(M), "--runs", json.dumps(runs)], CONFIG, timeout=600)


def test_each_layers_adapters_get_a_unit_and_the_layer_keeps_only_frozen_parameters(ranks):
    for rank in ranks:
        units = rank["runs"]["keep"]["units"]
        layers = [n for n in units if n.endswith(tuple(f"layers.{i}" for i in range(LAYERS)))]
        adapters = [n for n in units if "lora_A" in n]
        assert len(layers) == len(adapters) == LAYERS, units
        assert all(units[n] == [0, 12] for n in layers), units  # 12 base tensors per Qwen2 layer
        assert all(units[n] == [4, 0] for n in adapters), units  # q and v: lora_A and lora_B each
        assert all(frozen == 0 or trained == 0 for trained, frozen in units.values()), units
        assert frozen_units(rank) in (1 + LAYERS, 2 + LAYERS), units
        stock = rank["runs"]["stock"]["units"]
        assert all(stock[n] == [4, 12] for n in layers), stock  # without it, one unit holds both


# The compatibility suite (-m compat, every stack): FSDP2's reshard flags and units differ by release.
@pytest.mark.compat
def test_after_the_first_step_only_the_adapters_are_gathered(ranks):
    per_step = LAYERS * M * 2  # each adapter unit in each micro-batch's forward and backward
    for rank in ranks:
        steps = rank["runs"]["keep"]["steps"]
        assert steps[0]["all_gathers"] == per_step + frozen_units(rank), steps[0]  # the kept units once
        for step in steps[1:]:
            assert step["all_gathers"] == per_step, step
            assert step["gathered_bytes"] == per_step * ADAPTER_NUMEL * 4, step  # fp32 adapters only
        stock = rank["runs"]["stock"]["steps"]
        assert all(s["gathered_bytes"] > 10 * steps[1]["gathered_bytes"] for s in stock), stock
        # stats(): the kept units and their bytes, from the model's sizes (fp32): the root's final
        # norm, the tied embeddings (vocab x hidden), each layer's base (all but its adapters).
        total = sum(
            len(v) if isinstance(v[0], float) else len(v) * len(v[0]) for v in rank["runs"]["keep"]["params"].values()
        )
        stats = rank["runs"]["keep"]["stats"]
        assert stats["units_resident"] == frozen_units(rank) and rank["runs"]["stock"]["stats"]["units_resident"] == 0
        assert stats["resident_param_bytes"] == (total - LAYERS * ADAPTER_NUMEL) * 4, stats
        decision = rank["runs"]["keep"]["decision"]
        assert (
            f"{per_step} all-gathers/step" in decision
            and f"of {frozen_units(rank)} frozen units for the run" in decision
        )


@pytest.mark.compat
@pytest.mark.parametrize(
    "keep,stock",
    [
        ("keep", "stock"),
        ("keep_unfreeze", "stock_unfreeze"),
        ("keep_state_dict", "stock"),
        ("keep_save_load", "stock_save_load"),
        ("keep_raise", "stock_raise"),
        ("keep_merge", "stock_merge"),
        ("keep_generate", "stock_generate"),
        ("keep_evaluate", "stock_evaluate"),
        ("keep_reshard_mid_window", "stock"),
    ],
)
def test_losses_and_parameters_equal_the_run_without_it(ranks, keep, stock):
    for rank in ranks:
        mine, theirs = rank["runs"][keep], rank["runs"][stock]
        assert [s["losses"] for s in mine["steps"]] == [s["losses"] for s in theirs["steps"]]
        assert mine["params"] == theirs["params"]
    if keep == "keep_unfreeze":  # the unfrozen layer trained
        first = ranks[0]["runs"]["keep"]["params"]
        moved = [n for n in first if "layers.1.mlp" in n and first[n] != ranks[0]["runs"][keep]["params"][n]]
        assert moved, "the unfrozen MLP did not train"


@pytest.fixture(scope="module")
def bf16():
    """accelerate's bf16 mixed precision: FSDP2 casts each unit's parameters to bf16 to gather them."""
    runs = [{"name": "stock", "config": {}}, {"name": "keep", "config": KEEP}]
    return launch("frozen_units", ["--M", str(M), "--runs", json.dumps(runs)], {**CONFIG, "mixed_precision": "bf16"})


def test_under_bf16_the_kept_copy_and_the_adapters_gathered_are_bf16_and_exact(bf16):
    per_step = LAYERS * M * 2
    for rank in bf16:
        keep, stock = rank["runs"]["keep"], rank["runs"]["stock"]
        assert all(step["gathered_bytes"] == per_step * ADAPTER_NUMEL * 2 for step in keep["steps"][1:]), keep
        assert "unsharded bfloat16 params of" in keep["decision"], keep["decision"]
        assert [s["losses"] for s in keep["steps"]] == [s["losses"] for s in stock["steps"]]
        assert keep["params"] == stock["params"]


def test_a_base_layer_unfrozen_reshards_again(ranks):
    for rank in ranks:
        steps = rank["runs"]["keep_unfreeze"]["steps"]
        # Layer 1 is released before step 2: gathered in each micro-batch's forward and backward
        # again. Binding the model again reshards every unit (the next all-gather carries the new
        # flags): the units still kept are gathered once more in step 2, then no more.
        adapters, layer = LAYERS * M * 2, M * 2
        assert steps[1]["all_gathers"] == adapters + layer + frozen_units(rank) - 1, steps[1]
        assert steps[2]["all_gathers"] == adapters + layer, steps[2]


def test_a_state_dict_between_steps_costs_one_gather_of_each_kept_unit(ranks):
    for rank in ranks:
        steps = rank["runs"]["keep_state_dict"]["steps"]
        assert steps[1]["all_gathers"] == LAYERS * M * 2 + frozen_units(rank), steps[1]
        assert steps[2]["all_gathers"] == LAYERS * M * 2, steps[2]


@pytest.mark.compat
def test_merging_the_adapter_after_reshard_frozen_reads_what_stock_reads_and_regathers(ranks):
    for rank in ranks:
        keep, stock = rank["runs"]["keep_merge"], rank["runs"]["stock_merge"]
        assert keep["merged"] == stock["merged"] and len(keep["merged"]) == 12 * LAYERS + 2, sorted(keep["merged"])
        assert keep["merged"] != rank["runs"]["stock"]["params"]  # the merge moved the base: B is not zero
        # The kept units resharded for the merge are gathered once more at the next step, then no more.
        steps = [s["all_gathers"] for s in keep["steps"]]
        assert steps == [LAYERS * M * 2 + frozen_units(rank)] * 2 + [LAYERS * M * 2], steps
        # Without reshard_frozen(), PEFT's merge fails loudly (a plain tensor beside DTensors).
        assert "DTensor" in rank["runs"]["keep_merge_bare"]["error"], rank["runs"]["keep_merge_bare"]


def test_reshard_frozen_inside_a_window_regathers_the_kept_units_once_and_stays_exact(ranks):
    for rank in ranks:
        runs = rank["runs"]
        # The second micro-batch of step 2 gathers the kept units again; step 3 none of them.
        steps = [s["all_gathers"] for s in runs["keep_reshard_mid_window"]["steps"]]
        assert steps == [LAYERS * M * 2 + frozen_units(rank)] * 2 + [LAYERS * M * 2], steps
        # auto (adapters windowed): the same kept units once more, the adapters still once per step.
        auto, forecast = runs["auto_reshard_mid_window"], runs["auto_forecast"]
        steps = [s["all_gathers"] for s in auto["steps"]]
        assert steps == [LAYERS + frozen_units(rank), LAYERS + frozen_units(rank), LAYERS], steps
        assert auto["params"] == forecast["params"]  # the same run without the call


def test_under_a_trainer_with_use_vllm_true_is_refused_and_auto_keeps_nothing(ranks):
    for rank in ranks:
        error = rank["runs"]["vllm_keep"]["error"]
        assert "\n" not in error and "use_vllm=true" in error and "keep_frozen_unsharded=false" in error, error
        assert rank["runs"]["vllm_auto"] == {"keep_frozen_unsharded": False}, rank["runs"]["vllm_auto"]


def test_detach_leaves_every_parameter_sharded(ranks):
    for rank in ranks:
        trained = [run for run in rank["runs"].values() if "steps" in run]
        assert len(trained) == 25 and all(run["sharded_after_detach"] for run in trained)


def test_auto_keeps_under_budget_what_fits_and_nothing_elsewhere(ranks):
    for rank in ranks:
        everything, nothing = rank["runs"]["budget_all"], rank["runs"]["budget_none"]
        assert everything["stats"]["units_resident"] == frozen_units(rank), everything["stats"]
        # With 1 MiB the budget also windows the adapter units: each gathered once per step.
        assert [s["all_gathers"] for s in everything["steps"]][1:] == [LAYERS] * (STEPS - 1)
        assert nothing["stats"]["units_resident"] == 0, nothing["stats"]
        # Split where a frozen layer would be kept; with room for none, left as accelerate shards it.
        assert len(everything["units"]) > len(nothing["units"]) == len(rank["runs"]["stock"]["units"])
        assert rank["runs"]["stock"]["stats"]["units_resident"] == 0  # per_micro_batch: auto keeps nothing


def test_auto_plans_step_1_from_the_forecast_of_the_split_model_with_its_kept_units(ranks):
    for rank in ranks:
        run = rank["runs"]["auto_forecast"]
        why = run["decision"].splitlines()[-1]
        assert "auto planned step 1 from the forecast" in why and "failed" not in why, why
        assert "of frozen units kept unsharded" in why, why
        assert run["stats"]["units_resident"] == frozen_units(rank), run["stats"]
        # 64 MiB is room for everything: the adapter units windowed (one all-gather each per step),
        # the frozen ones gathered at step 1 only.
        assert [s["all_gathers"] for s in run["steps"]] == [LAYERS + frozen_units(rank)] + [LAYERS] * (STEPS - 1)


@pytest.mark.compat  # the gates read FSDP2's hooks and flags, which differ by release
def test_generation_skips_fsdp2s_forward_work_on_the_kept_units_in_every_mode(ranks):
    for rank in ranks:
        runs = rank["runs"]
        # Stock runs FSDP2's pre- and post-forward on every frozen unit (there: the root and the
        # embeddings) at every generation forward.
        stock = runs["stock_generate"]
        frozen_in_stock = sum(1 for trained, _ in stock["units"].values() if trained == 0)
        assert frozen_in_stock > 0 and stock["frozen_forward_records"] == frozen_in_stock * TOKENS, stock["units"]
        # Kept for the run, a frozen unit is unsharded and stays so: nothing for FSDP2 to do at a
        # forward without gradients. FSDP2's root, whose post-forward completes the adapters'
        # grouped units, runs its hooks where they gather: under auto (adapters windowed) at the
        # first forward alone, under per_micro_batch (`true`) at every forward.
        for name, records in (("auto_generate", 1), ("keep_generate", TOKENS)):
            assert runs[name]["stats"]["units_resident"] == frozen_units(rank), runs[name]["stats"]
            assert runs[name]["frozen_forward_records"] == records, (name, runs[name]["frozen_forward_records"])
        assert runs["keep_generate"]["generated"] == stock["generated"]
        # Between steps too (an evaluation): the kept units idle, stock's logits.
        evaluate, stock_evaluate = runs["keep_evaluate"], runs["stock_evaluate"]
        assert evaluate["evaluated"] == stock_evaluate["evaluated"]
        assert stock_evaluate["frozen_forward_records"] == frozen_in_stock * TOKENS, stock_evaluate
        assert evaluate["frozen_forward_records"] == TOKENS, evaluate  # the root's, as keep_generate's
        # auto reduces the same gradients once per step: the same logits to float rounding.
        auto, want = _flatten(runs["auto_generate"]["generated"]), _flatten(stock["generated"])
        assert len(auto) == len(want) and auto == pytest.approx(want, rel=1e-4, abs=1e-6)


def _flatten(nested) -> list[float]:
    return [x for item in nested for x in _flatten(item)] if isinstance(nested, list) else [nested]


def test_per_rank_counts_end_where_padding_ends_and_the_kept_units_stay_gathered(ranks):
    for r, rank in enumerate(ranks):
        runs = rank["runs"]
        own, largest = [c[r] for c in UNEVEN], [max(c) for c in UNEVEN]
        for name in ("keep_uneven", "auto_uneven"):
            mine, padded = runs[name], runs[f"{name}/pad"]
            assert mine["params"] == padded["params"], name
            assert mine["stats"]["units_resident"] == frozen_units(rank), mine["stats"]
        # per_micro_batch (`true`): the short rank replays its last micro-batch x 0 up to the
        # largest count, so its all-gathers are the padded run's, one for one; the kept units
        # are gathered at the first step alone either way.
        keep, keep_pad = runs["keep_uneven"], runs["keep_uneven/pad"]
        assert [s["all_gathers"] for s in keep["steps"]] == [s["all_gathers"] for s in keep_pad["steps"]]
        adapters = [LAYERS * 2 * most for most in largest]  # forward and backward of each micro-batch
        assert [s["all_gathers"] for s in keep["steps"]] == [adapters[0] + frozen_units(rank), *adapters[1:]]
        assert keep["stats"]["replayed_micro_batches"] == sum(largest) - sum(own), keep["stats"]
        # auto windows the adapters: each gathered once per step whatever the counts, nothing replayed.
        auto = runs["auto_uneven"]
        assert [s["all_gathers"] for s in auto["steps"]] == [LAYERS + frozen_units(rank)] + [LAYERS] * (STEPS - 1)
        assert auto["stats"]["replayed_micro_batches"] == 0, auto["stats"]
        assert auto["stats"]["evened_micro_batches"] == sum(largest) - sum(own), auto["stats"]


def test_a_model_prepared_before_attach_is_refused_in_one_line(ranks):
    for rank in ranks:
        error = rank["runs"]["attach_after_prepare"]["error"]
        assert "\n" not in error and "keep_frozen_unsharded=true" in error, error
        assert "call attach() before accelerator.prepare(model)" in error, error


def test_auto_says_in_one_line_that_it_keeps_nothing_of_a_model_prepared_before_attach(ranks):
    """budget_all, attached first, keeps every frozen unit; prepared first, its units mix adapters
    and base (none without a trainable parameter but the root's), and attach's line says so."""
    for r, rank in enumerate(ranks):
        run = rank["runs"]["budget_after_prepare"]
        layers = [units for name, units in run["units"].items() if name.endswith(("layers.0", "layers.1"))]
        assert layers == [[4, 12]] * LAYERS, run["units"]  # adapters and base in one unit: nothing to keep
        lines = [line for line in run["printed"].splitlines() if "keep_frozen_unsharded" in line]
        if r == 0:  # accelerator.print: the main process only
            assert len(lines) == 1 and "keeps no frozen unit" in lines[0], run["printed"]
            assert "call attach() before accelerator.prepare(model)" in lines[0], lines
        else:
            assert lines == [], run["printed"]


@pytest.fixture(scope="module")
def hsdp():
    """A 2x2 HSDP mesh: the adapters' units get the layer's 2-D mesh; all-gathers run within a replica."""
    config = accelerate_config("fsdp2", num_processes=4, fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
    config["parallelism_config"] = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    runs = [
        {"name": "stock", "config": {}},
        {"name": "keep", "config": KEEP},
        {"name": "stock_merge", "config": {}, "merge_at": 1},
        {"name": "keep_merge", "config": KEEP, "merge_at": 1},
    ]
    return launch("frozen_units", ["--M", str(M), "--runs", json.dumps(runs)], config)


@pytest.mark.slow  # 4 processes on 2 cores; test_modes holds every mode on an HSDP mesh
def test_on_an_hsdp_mesh_only_the_adapters_are_gathered_after_step_1_and_it_is_exact(hsdp):
    per_step = LAYERS * M * 2
    assert len(hsdp) == 4
    for rank in hsdp:
        runs = rank["runs"]
        steps = runs["keep"]["steps"]
        assert steps[0]["all_gathers"] == per_step + frozen_units(rank), steps[0]
        assert all(s["all_gathers"] == per_step for s in steps[1:]), steps
        # Each rank holds half a replica's shards: an all-gather's output is the whole adapter.
        assert all(s["gathered_bytes"] == per_step * ADAPTER_NUMEL * 4 for s in steps[1:]), steps
        for keep, stock in (("keep", "stock"), ("keep_merge", "stock_merge")):
            assert [s["losses"] for s in runs[keep]["steps"]] == [s["losses"] for s in runs[stock]["steps"]]
            assert runs[keep]["params"] == runs[stock]["params"]
        assert runs["keep_merge"]["merged"] == runs["stock_merge"]["merged"]
        assert all(run["sharded_after_detach"] for run in runs.values())


@pytest.fixture(scope="module")
def fsdp1():
    config = accelerate_config(
        "fsdp1", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer", fsdp_use_orig_params=True
    )
    runs = [{"name": "keep", "config": KEEP, "refused": True}]
    return launch("frozen_units", ["--M", str(M), "--runs", json.dumps(runs)], config)


def test_fsdp1_is_refused_in_one_line_at_attach(fsdp1):
    for rank in fsdp1:
        error = rank["runs"]["keep"]["error"]
        assert "\n" not in error and "keep_frozen_unsharded=true needs FSDP2" in error, error
        assert "fsdp_version: 2" in error and "keep_frozen_unsharded=false" in error, error


# With activation checkpointing, as TRL defaults and the real-model YAML set it: each layer's
# forward, the kept units' included, runs again in the backward.
LORA = (
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py"
    " --use_peft --lora_r 8 --lora_target_modules q_proj v_proj --activation_checkpointing true"
)
PLUGIN = {
    "keep": " --grad-sync-log-all-counters --defer-grad-sync --grad-sync-keep-frozen-unsharded",
    "windowed": " --grad-sync-log-all-counters --defer-grad-sync --grad-sync-keep-params-unsharded",  # auto keeps
}


# The default suite: beta 0.04 (the reference is the policy with its adapter off); --slow: beta 0 too.
@pytest.fixture(scope="module", params=[pytest.param("0", marks=pytest.mark.slow), "0.04"], ids=lambda b: f"beta{b}")
def grpo(request, tmp_path_factory):
    """Under LoRA, TRL's reference (beta > 0) is the policy with its adapter off."""
    command = LORA + f" --beta {request.param}"
    runs = {
        name: run_command(command + flags, tmp_path_factory.mktemp(name), timeout=600)
        for name, flags in (("stock", ""), *PLUGIN.items())
    }
    return {**runs, "beta": float(request.param)}


def _gathers(rank: dict) -> int:
    return sum(rank["counts"].get(n, 0) for n in ("all_gather_single", "all_gather_into_tensor"))


@pytest.mark.parametrize("plugin", PLUGIN)
def test_grpo_with_lora_logs_what_stock_logs_and_gathers_less(grpo, plugin):
    stock, mine = grpo["stock"], grpo[plugin]
    assert len(mine["logs"]) == len(stock["logs"]) > 0
    assert all(("kl" in log) == (grpo["beta"] > 0) for log in mine["logs"]), mine["logs"]
    # Stock (the recipe without --defer-grad-sync) reduce-scatters every micro-batch, the plugin's
    # runs a step's sum once: the same sum in another floating-point order. The completions and so
    # the rewards are the same; the KL (exp(d) - d - 1 of a small d amplifies the rounding), the
    # loss that holds it and the grad norm agree to the last bits, where a lost or doubled
    # micro-batch would move them by 1/M.
    for logged, theirs in zip(mine["logs"], stock["logs"], strict=True):
        assert logged["reward"] == theirs["reward"], (logged, theirs)
        for key in ("loss", "kl", "grad_norm"):
            assert (key in logged) == (key in theirs), (key, logged, theirs)
            assert logged.get(key) == pytest.approx(theirs.get(key), rel=1e-5), (key, logged, theirs)
    last = mine["logs"][-1]
    for rank, stock_rank in zip(mine["ranks"], stock["ranks"], strict=True):
        assert rank["counts"].get("activation_checkpoint", 0) > 0, rank["counts"]
        # Every all-gather counted from outside is one the plugin's counters name; fewer than without.
        assert _gathers(rank) == last["grad_sync/all_gathers"] + last["grad_sync/generation_all_gathers"], rank
        assert _gathers(rank) < _gathers(stock_rank), (rank, stock_rank)
        if plugin == "windowed":  # stock's generation all-reduces at every decoded token, windowed's once
            assert rank["counts"]["all_reduce"] < stock_rank["counts"]["all_reduce"], (rank, stock_rank)
    line = next(line for line in mine["stdout"].splitlines() if line.startswith("grad sync: deferred"))
    assert "frozen units for the run" in line, line  # the window keeps them under auto, the default
