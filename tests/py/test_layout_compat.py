"""The package's old module paths and top-level names keep working after the move into
subpackages: each old path is the new module itself (so patches and pickles see one object),
importing it warns once with the new path, and models saved before the move still load and
compute what they computed then."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import npu_attn
from npu_attn import _compat

DATA = Path(__file__).parent / "data"


def forget(old: str) -> None:
    """Drop an old path from the import caches, so importing it runs the finder again."""
    sys.modules.pop(f"npu_attn.{old}", None)
    parent, _, child = f"npu_attn.{old}".rpartition(".")
    if parent in sys.modules and sys.modules[parent].__dict__.get(child) is not None:
        new = importlib.import_module(f"npu_attn.{_compat.MOVED[old]}")
        if sys.modules[parent].__dict__[child] is new:
            delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old", sorted(_compat.MOVED))
def test_an_old_module_path_is_the_new_module_and_warns(old):
    forget(old)
    new = importlib.import_module(f"npu_attn.{_compat.MOVED[old]}")
    parent = old.rpartition(".")[0]
    if parent in _compat.MOVED:  # an old package: importing it first warns with its own path
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(f"npu_attn.{parent}")
    with pytest.warns(DeprecationWarning, match=rf"npu_attn\.{old} moved to npu_attn\."):
        module = importlib.import_module(f"npu_attn.{old}")
    assert module is new


def test_from_imports_of_old_paths_work():
    forget("token_merging")
    forget("_backends.registry")
    forget("_backends")
    with pytest.warns(DeprecationWarning):
        from npu_attn import token_merging
        from npu_attn._backends.registry import get
    from npu_attn.accel import token_merging as moved
    from npu_attn.attention.backends.registry import get as moved_get

    assert token_merging is moved and get is moved_get


@pytest.mark.parametrize("home", ["runtime", "parallel"])
def test_moved_top_level_names_warn_and_are_the_same_functions(home):
    names = [n for n, h in npu_attn._MOVED.items() if h == home]
    assert names
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"npu_attn.{name} moved to npu_attn.{home}"):
            old = getattr(npu_attn, name)
        assert old is getattr(importlib.import_module(f"npu_attn.{home}"), name)


def test_the_curated_api_resolves_without_warnings(recwarn):
    for name in npu_attn.__all__:
        assert getattr(npu_attn, name) is not None
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    assert not set(npu_attn.__all__) & set(npu_attn._MOVED)


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = npu_attn.no_such_name


def load_saved_before_the_move(name: str):
    with pytest.warns(DeprecationWarning):  # the pickle names the old module paths
        return torch.load(DATA / f"{name}_saved_before_the_layout_change.pt", weights_only=False)


def test_a_unet_saved_before_the_move_loads_and_computes_the_same():
    """Saved with the old layout: tiled attention processors and Token Merging mid-stream (its
    generator state included). It computes exactly what the same model built, switched and run
    once now computes (the saved output is only float-rounding close: the kernels have changed
    since it was saved)."""
    from npu_attn.accel.token_merging import apply_token_merging
    from tiny_accel_models import run, tiny_sd15_unet

    for old in ("diffusers_integration", "token_merging"):
        forget(old)
    saved = load_saved_before_the_move("unet")
    assert set(npu_attn.attention_strategy_of(saved["model"])) == {"tiled"}
    fresh = tiny_sd15_unet()
    npu_attn.set_attention_strategy(fresh, "tiled")
    with torch.no_grad():
        apply_token_merging(fresh, {"ratio": 0.5, "seed": 3})
        run(fresh)  # where the saved one was when it was saved
        loaded = run(saved["model"])
        assert torch.equal(loaded, run(fresh))
    torch.testing.assert_close(loaded, saved["expected"], rtol=1e-4, atol=1e-5)


def test_a_transformer_saved_before_the_move_loads_and_continues_its_block_cache():
    """Saved mid-generation with First Block Cache: it reuses the residual it cached then (so it
    matches a model built now to float rounding only: that residual came from the older
    kernels) and counts the skipped call."""
    from npu_attn.accel.block_cache import block_cache_of
    from tiny_accel_models import tiny_sd3_transformer, transformer_call

    for old in ("diffusers_integration", "block_cache"):
        forget(old)
    saved = load_saved_before_the_move("transformer")
    fresh = tiny_sd3_transformer()
    npu_attn.set_attention_strategy(fresh, "tiled")
    npu_attn.accelerate(fresh, block_cache={"interval": 3})
    with torch.no_grad():
        transformer_call(fresh, 900.0)
        loaded = transformer_call(saved["model"], 800.0)
        torch.testing.assert_close(loaded, transformer_call(fresh, 800.0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loaded, saved["expected"], rtol=1e-4, atol=1e-5)
    assert block_cache_of(saved["model"])["skipped_calls"] == 1


def test_an_old_path_leaves_the_module_its_own_spec():
    """Relative imports inside the module resolve against its own package, not the old one."""
    forget("functional")
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module("npu_attn.functional")
    assert module.__spec__.name == "npu_attn.attention.functional"
    assert module.__spec__.parent == module.__package__ == "npu_attn.attention"


def test_folders_are_attributes_after_a_plain_import():
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('error'); import npu_attn; "
        "print(npu_attn.parallel.enable_cfg_parallel.__module__, npu_attn.runtime.set_isa.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["npu_attn.parallel.cfg", "set_isa"]
