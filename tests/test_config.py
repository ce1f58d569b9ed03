"""DARTreeConfig: defaults, and every invalid value names its key."""

import pytest
from pydantic import ValidationError

from vllm_dartree import DARTreeConfig


def test_paper_defaults():
    cfg = DARTreeConfig()
    assert (cfg.variant, cfg.budget, cfg.width, cfg.topk, cfg.depth_bonus) == \
        ("pruned", 64, 12, 64, -0.2)
    assert (cfg.builder, cfg.correction, cfg.max_depth) == ("dartree", True, None)


@pytest.mark.parametrize("key,value", [
    ("variant", "wide"), ("budget", 0), ("width", 0), ("topk", 0), ("depth_bonus", 0.1),
    ("depth_bonus", float("nan")), ("max_depth", 0), ("builder", "beam"),
    ("correction", "maybe"), ("budget", "many"),
])
def test_invalid_value_names_the_key(key, value):
    with pytest.raises(ValidationError) as err:
        DARTreeConfig(**{key: value})
    assert key in str(err.value)


def test_positive_depth_bonus_says_why():
    with pytest.raises(ValidationError, match="Lemma 1"):
        DARTreeConfig(depth_bonus=0.5)


def test_unknown_key_is_refused():
    with pytest.raises(ValidationError, match="bugdet"):
        DARTreeConfig(bugdet=64)


def test_sequential_heap_needs_correction():
    with pytest.raises(ValidationError, match="correction"):
        DARTreeConfig(builder="sequential-heap", correction=False)


def test_drafter_dependent_keys():
    with pytest.raises(ValueError, match="topk"):
        DARTreeConfig(topk=100).check_drafter(vocab_size=50, num_depths=16)
    with pytest.raises(ValueError, match="max_depth"):
        DARTreeConfig(max_depth=20).check_drafter(vocab_size=50000, num_depths=16)
    DARTreeConfig(topk=50, max_depth=16).check_drafter(vocab_size=50, num_depths=16)
    assert DARTreeConfig(max_depth=4).num_depths(16) == 4
    assert DARTreeConfig().num_depths(15) == 15
