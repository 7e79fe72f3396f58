import pytest

from kiln.registry import DATASETS, MODELS, Registry, UnknownNameError


def test_duplicate_name_raises():
    registry = Registry("widget")
    registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a")(lambda: 2)


def test_unknown_name_lists_known_names_and_closest_match():
    with pytest.raises(UnknownNameError) as info:
        MODELS.get("resnet19")
    message = str(info.value)
    assert "unknown model 'resnet19'" in message
    assert "mlp" in message and "resnet50" in message
    assert "Did you mean 'resnet18'?" in message


def test_registries_hold_the_contract_names():
    assert {"digits", "synthetic_images", "csv_text", "shapes_detection"} <= set(DATASETS.names())
    expected = {"mlp", "resnet18", "resnet50", "text_bow", "text_transformer", "detector"}
    assert expected <= set(MODELS.names())
