"""bind.py's naming of models in stats(): the user's class name, `#n` for the n-th model of a
class bound, whatever other classes were bound before."""

from types import SimpleNamespace

from torch import nn

from accel_gradsync.runtime.integration.bind import unique_name


class Policy(nn.Linear):
    pass


class Ref(nn.Linear):
    pass


def names_bound_in_order(*models: nn.Module) -> list[str]:
    """Each model named as bound after the ones before it (trained or frozen: one namespace)."""
    state = SimpleNamespace(bound={}, frozen={})
    names = []
    for i, model in enumerate(models):
        name = unique_name(model, state)  # naming reads the state's names alone
        (state.bound if i % 2 else state.frozen)[model] = SimpleNamespace(name=name)
        names.append(name)
    return names


def test_the_second_model_of_a_class_is_number_two_after_other_classes():
    assert names_bound_in_order(Policy(1, 1), Ref(1, 1), Ref(1, 1)) == ["Policy", "Ref", "Ref#2"]


def test_each_class_counts_its_own_models():
    models = (Policy(1, 1), Ref(1, 1), Policy(1, 1), Ref(1, 1), Ref(1, 1))
    assert names_bound_in_order(*models) == ["Policy", "Ref", "Policy#2", "Ref#2", "Ref#3"]
