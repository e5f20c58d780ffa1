"""skip_token_sync (runtime/generating/token_sync.py) on a real transformers model, one process: what its
`generate` is called with, and that the handle takes the wrapper off. What it saves on real ranks
is counted in tests/distributed/test_uneven_generation.py."""

import pytest
import torch
from torch import nn

from accel_gradsync.runtime.generating.token_sync import SyncProof, skip_token_sync

transformers = pytest.importorskip("transformers")


def tiny_model(attention_dropout: float = 0.0) -> nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        attention_dropout=attention_dropout,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


class Recorder:
    """Stands where torch's `register_fsdp_forward_method` puts its wrapper: an instance `generate`
    that records the keyword arguments it is called with, then generates."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[dict] = []
        self.generate = model.generate

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.generate(*args, **kwargs)


@pytest.fixture
def model():
    model = tiny_model()
    model.generate = Recorder(model)
    return model


def generate(model: nn.Module, **kwargs) -> torch.Tensor:
    ids = torch.tensor([[1, 2, 3]])
    kwargs.setdefault("max_new_tokens", 2)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)


@pytest.mark.parametrize("kept", [True, False])
def test_synced_gpus_is_false_only_while_every_unit_is_kept(model, kept):
    recorder = model.generate
    handles = skip_token_sync(model, lambda: kept)
    assert len(handles) == 1
    generate(model)  # the first keeps transformers' default: it proves the forwards issue no collective
    assert "synced_gpus" not in recorder.calls[-1]
    generate(model)
    assert recorder.calls[-1].get("synced_gpus") is (False if kept else None)


def test_one_forward_proves_nothing(model):
    recorder = model.generate
    skip_token_sync(model, lambda: True)
    for _ in range(2):
        generate(model, max_new_tokens=1)  # a single forward: the one that gathers
        assert "synced_gpus" not in recorder.calls[-1]


def test_forwards_that_draw_keep_the_sync_in_their_mode_only():
    """Dropout in train mode draws at every forward: the sync stays on there (a rank done first
    draws on under it, as stock's does); in eval mode the same model is proven free and runs
    without it."""
    model = tiny_model(attention_dropout=0.5)
    model.generate = recorder = Recorder(model)
    skip_token_sync(model, lambda: True)
    for training in (True, True, True, False, False, True):
        model.train(training)
        generate(model, max_new_tokens=3)
    # Train mode: transformers' default every time. Eval mode: the first proves, the second skips.
    assert [call.get("synced_gpus") for call in recorder.calls] == [None, None, None, None, False, None]


def lora_model(lora_dropout: float) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=lora_dropout)
    return peft.get_peft_model(tiny_model(), config).base_model.model  # the module whose generate decides


@pytest.mark.compat  # a decoding forward's input and draws, by transformers and PEFT release
@pytest.mark.parametrize(
    ("make", "replays"),
    [(lambda: lora_model(0.5), True), (lambda: tiny_model(attention_dropout=0.5), False)],
    ids=["lora_dropout", "attention_dropout"],
)
def test_a_replayed_token_draws_as_a_decoded_one_where_the_draws_ignore_the_cache(make, replays):
    """PEFT's dropout draws a mask the size of one token's activations whatever the cache holds; attention
    dropout draws one the size of the attention over the cache, which a forward without it does not. The
    generators are where the generation left them afterwards."""
    model = make().train()
    proof = SyncProof()
    with proof.watching(model):
        generate(model, max_new_tokens=3)
        after = torch.get_rng_state()
    assert proof.draws == {True: True}
    assert proof.replays == {True: replays}
    assert proof.replayable(True) is replays and not proof.free(True)
    assert torch.equal(torch.get_rng_state(), after)


def test_a_value_the_caller_passes_is_kept(model):
    recorder = model.generate
    recorder.generate = lambda *args, **kwargs: None  # synced_gpus=True would all-reduce: no process group here
    skip_token_sync(model, lambda: True)
    generate(model, synced_gpus=True)
    assert recorder.calls[-1]["synced_gpus"] is True


def test_the_same_tokens_with_and_without(model):
    before = generate(model)
    skip_token_sync(model, lambda: True)
    assert torch.equal(generate(model), before)


def test_removing_puts_the_instance_generate_back():
    plain, recorded = tiny_model(), tiny_model()
    recorded.generate = recorder = Recorder(recorded)
    for model, own in ((plain, None), (recorded, recorder)):
        handles = skip_token_sync(model, lambda: True)
        assert vars(model)["generate"] is not own
        handles[0].remove()
        assert vars(model).get("generate") is own
        assert type(model).generate is transformers.GenerationMixin.generate  # the class untouched


def test_wrapped_again_by_someone_else_it_passes_calls_through(model):
    recorder = model.generate
    handles = skip_token_sync(model, lambda: True)
    outer = Recorder(model)  # e.g. FSDP2 registering generate after attach
    model.generate = outer
    handles[0].remove()
    assert vars(model)["generate"] is outer  # theirs stays
    generate(model)
    assert "synced_gpus" not in recorder.calls[-1]


def test_nothing_to_wrap_on_a_module_that_is_no_transformers_model():
    assert skip_token_sync(nn.Sequential(nn.Linear(2, 2)), lambda: True) == []
