"""Generation without transformers' per-token all-reduce (runtime/generating/token_sync.py), on real gloo
ranks with transformers' own `generate` (workers/token_sync.py): the two ranks ask for different
numbers of new tokens (3 and 7), so a rank that finishes first and stops running forwards would
leave the other alone in any all-gather its forwards issue.

- Where every FSDP2 unit stays unsharded through the generation (the window's units, generating
  inside its first micro-batch as TRL does; `gather_for_generation` before the window), the first
  generation runs with transformers' default and proves that no forward after the first issues a
  collective; from the second on, no all-reduce runs during `generate`: each rank stops at its own
  length, nothing hangs, and the tokens and losses equal the run with transformers' default.
- A model whose forward issues a collective of its own (a decoder layer all-reducing, as tensor
  parallel does) keeps transformers' default at every generation: it would hang otherwise.
- Where units reshard after each forward (per_micro_batch without the setting), transformers'
  default holds: one all-reduce per decoding loop on every rank, max(tokens) + 1 (the last finds
  every rank done), and the rank done first keeps running forwards with the other.
- A model whose forwards draw random numbers over the cache while it generates (attention dropout
  in train mode, as TRL generates) keeps transformers' default too: the rank done first runs its
  forwards on, drawing what it draws under stock, so each rank's random state, and the dropout
  masks and losses after it, stay stock's. In eval mode the same model runs without the sync.
- Under PEFT LoRA with dropout (drawn on one token's activations, whatever the cache) the model
  runs without the sync after the proof and ends each generation with one all-reduce; the rank
  done first replays the forwards it is short and ends with stock's random state.
- `synced_gpus=True` passed by the caller is kept; detach puts the model's `generate` back.
"""

import pytest
from launcher import accelerate_config, launch

TOKENS = [3, 7]  # rank r asks for 3 + 4r new tokens
SYNCED = max(TOKENS) + 1  # transformers' per-token flag all-reduces: one per loop, the last finds all done
CONFIG = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
WINDOWED = {"defer": True, "keep_params_unsharded": True}
RUNS = [
    {"name": "stock", "config": {}, "at": "outside"},
    {"name": "windowed_inside", "config": WINDOWED, "at": "inside"},
    {"name": "gather_for_generation", "config": {"gather_for_generation": True}, "at": "outside"},
    {"name": "caller_synced", "config": {"gather_for_generation": True}, "at": "outside", "synced_gpus": True},
    {
        "name": "collective_in_forward",
        "config": {"gather_for_generation": True},
        "at": "outside",
        "collective_in_forward": True,
    },
    {"name": "dropout_stock", "config": {}, "at": "inside", "dropout": 0.5},
    {"name": "dropout_windowed_inside", "config": WINDOWED, "at": "inside", "dropout": 0.5},
    {"name": "dropout_stock_eval", "config": {}, "at": "inside", "dropout": 0.5, "eval": True},
    {"name": "dropout_windowed_eval", "config": WINDOWED, "at": "inside", "dropout": 0.5, "eval": True},
    {"name": "lora_stock", "config": {}, "at": "inside", "lora_dropout": 0.5},
    {"name": "lora_windowed_inside", "config": WINDOWED, "at": "inside", "lora_dropout": 0.5},
]


@pytest.fixture(scope="module")
def ranks():
    import json

    return launch("token_sync", ["--runs", json.dumps(RUNS)], CONFIG)


def test_each_rank_generates_its_own_length(ranks):
    for r, rank in enumerate(ranks):
        assert rank["tokens"] == TOKENS[r]
        for name, run in rank["runs"].items():
            for step in run["steps"]:
                assert {len(c) for c in step["completions"]} == {TOKENS[r]}, name


def test_no_all_reduce_per_token_where_every_unit_stays_unsharded(ranks):
    for rank in ranks:
        for name in ("windowed_inside", "gather_for_generation"):
            proof, *later = rank["runs"][name]["steps"]
            assert proof["generate"]["all_reduces"] == SYNCED, (name, proof["generate"])  # transformers' default
            for step in later:
                assert step["generate"]["all_reduces"] == 0, (name, step["generate"])
                assert step["generate"]["all_gathers"] > 0, name  # the first forward gathered the units


def test_a_generation_drawing_random_numbers_keeps_the_sync_and_stocks_random_state(ranks):
    """Dropout active in generation: every generation synced as stock's, and after each the
    rank's random state, the tokens and the training losses (dropout masks drawn after it) are
    stock's; generating in eval mode, the same model runs unsynced after the proof."""
    for rank in ranks:
        stock, mine = rank["runs"]["dropout_stock"]["steps"], rank["runs"]["dropout_windowed_inside"]["steps"]
        for step, theirs in zip(mine, stock, strict=True):
            assert step["generate"]["all_reduces"] == SYNCED, step["generate"]
            assert step["generate"]["rng"] == theirs["generate"]["rng"]
            assert step["completions"] == theirs["completions"]
            assert step["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
        stock, mine = rank["runs"]["dropout_stock_eval"]["steps"], rank["runs"]["dropout_windowed_eval"]["steps"]
        assert [s["generate"]["all_reduces"] for s in mine] == [SYNCED, 0]
        assert [s["completions"] for s in mine] == [s["completions"] for s in stock]


@pytest.mark.compat  # reads transformers' decoding forwards (their input_ids) and PEFT's dropout, which move by release
def test_lora_dropout_runs_unsynced_and_the_rank_done_first_draws_what_it_draws_under_the_sync(ranks):
    """PEFT's dropout draws the same at every decoded token whatever the cache: after the proof,
    each generation runs without the sync and ends with one all-reduce (the most forwards of any
    rank); the rank done first (3 tokens) then replays the 4 forwards it runs on under the sync, so
    its random state, tokens and losses are stock's."""
    for rank in ranks:
        stock, mine = rank["runs"]["lora_stock"]["steps"], rank["runs"]["lora_windowed_inside"]["steps"]
        assert [s["generate"]["all_reduces"] for s in stock] == [SYNCED] * len(stock)
        assert [s["generate"]["all_reduces"] for s in mine] == [SYNCED] + [1] * (len(mine) - 1)
        for step, theirs in zip(mine, stock, strict=True):
            assert step["generate"]["rng"] == theirs["generate"]["rng"]
            assert step["completions"] == theirs["completions"]
            assert step["losses"] == pytest.approx(theirs["losses"], rel=1e-5)


def test_a_forward_with_a_collective_of_its_own_keeps_the_per_token_sync(ranks):
    """Every generation: the per-token flag's all-reduces and one of the layer's per forward, each
    rank running max(TOKENS) forwards (the rank done first runs on with the other)."""
    for rank in ranks:
        for step in rank["runs"]["collective_in_forward"]["steps"]:
            assert step["generate"]["all_reduces"] == SYNCED + max(TOKENS), step["generate"]


def test_transformers_default_where_units_reshard_and_where_the_caller_asks(ranks):
    for rank in ranks:
        for name in ("stock", "caller_synced"):
            for step in rank["runs"][name]["steps"]:
                assert step["generate"]["all_reduces"] == SYNCED, (name, step["generate"])


def test_same_tokens_and_losses_as_transformers_default(ranks):
    for rank in ranks:
        stock = rank["runs"]["stock"]["steps"]
        for name in ("windowed_inside", "gather_for_generation", "caller_synced", "collective_in_forward"):
            steps = rank["runs"][name]["steps"]
            assert [s["completions"] for s in steps] == [s["completions"] for s in stock], name
            for mine, theirs in zip(steps, stock, strict=True):
                assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-5), name


def test_detach_puts_generate_back(ranks):
    for rank in ranks:
        assert all(run["generate_restored"] for run in rank["runs"].values())
