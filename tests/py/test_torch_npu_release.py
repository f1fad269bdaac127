"""npu_attn's Ascend calls checked against the real torch_npu 2.13.0 release, read as files
(torch_npu_release.py; importing it needs CANN): every call exists there with the argument names
and types npu_attn passes, the translation of SDPA's arguments relies on the schema's defaults
and documented semantics, and the stand-in the behavioural tests use (test_npu_backend's
FakeTorchNpu) agrees with the real schema, so the two cannot drift apart."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import torch_npu_release as release
from npu_attn.attention.backends import npu as npu_backend
from npu_attn.device import TorchProbe
from test_npu_backend import FakeTorchNpu

pytestmark = pytest.mark.skipif(release.available() is not None, reason=str(release.available()))

PYTHON_TYPES = {
    "Tensor": (torch.Tensor,),
    "int": (int,),
    "float": (float, int),
    "str": (str,),
    "bool": (bool,),
}


class Recorder(FakeTorchNpu):
    """The stand-in, also keeping each call's exact positional and keyword arguments."""

    def __init__(self):
        super().__init__()
        self.raw = []

    def npu_fusion_attention(self, *args, **kwargs):
        self.raw.append((args, kwargs))
        return super().npu_fusion_attention(*args, **kwargs)


def bind(op: str, args: tuple, kwargs: dict) -> dict:
    """The call bound to the release's schema of ``op``: raises TypeError for an argument the
    release does not have, a missing one, or a value of the wrong type."""
    arguments = release.schema(op)
    params = [
        inspect.Parameter(
            a.name,
            inspect.Parameter.KEYWORD_ONLY
            if a.keyword_only
            else inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=inspect.Parameter.empty if a.default is None else a.default,
        )
        for a in arguments
    ]
    bound = inspect.Signature(params).bind(*args, **kwargs).arguments
    for a in arguments:
        if a.name not in bound:
            continue
        value = bound[a.name]
        base = a.type.rstrip("?")
        if value is None and a.type.endswith("?"):
            continue
        expected = PYTHON_TYPES.get(base)
        if expected is None or (isinstance(value, bool) and base != "bool"):
            raise TypeError(f"{op}: {a.name} is {a.type}, got {type(value).__name__}")
        if not isinstance(value, expected):
            raise TypeError(f"{op}: {a.name} is {a.type}, got {type(value).__name__}")
    return bound


CALLS = {
    "plain": {},
    "bool mask": {"attn_mask": "bool"},
    "float mask": {"attn_mask": "float"},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
    "dropout": {"dropout_p": 0.1},
    "gqa": {"gqa": True},
    "key padding mask": {"attn_mask": "key padding"},
    "per-head mask": {"attn_mask": "per head"},
}


def npu_call(monkeypatch, case: dict):
    """What npu_attn's npu backend passes to torch_npu.npu_fusion_attention for one SDPA call."""
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "torch_npu", recorder)
    g = torch.Generator().manual_seed(0)
    b, h, lq, lk, d = 2, 4, 8, 12, 16
    hk = 2 if case.get("gqa") else h
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float16)
    k = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float16)
    v = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float16)
    mask = {
        None: None,
        "bool": torch.rand(lq, lk, generator=g) > 0.3,
        "float": torch.randn(b, 1, lq, lk, generator=g),
        "key padding": torch.rand(b, 1, 1, lk, generator=g) > 0.3,
        "per head": torch.rand(1, h, lq, lk, generator=g) > 0.3,
    }[case.get("attn_mask")]
    npu_backend.fusion_attention(
        q,
        k,
        v,
        mask,
        case.get("dropout_p", 0.0),
        case.get("is_causal", False),
        case.get("scale"),
        case.get("gqa", False),
    )
    ((args, kwargs),) = recorder.raw
    return args, kwargs, (b, h, lq, lk)


@pytest.mark.parametrize("case", CALLS)
def test_the_fused_attention_call_binds_to_the_release_schema(case, monkeypatch):
    args, kwargs, (b, h, lq, lk) = npu_call(monkeypatch, CALLS[case])
    bound = bind("npu_fusion_attention", args, kwargs)
    assert bound["input_layout"] in ("BSH", "SBH", "BSND", "BNSD", "TND")
    assert bound["head_num"] == bound["query"].shape[1] == bound["key"].shape[1]
    mask = bound.get("atten_mask")
    if mask is not None:
        # The documented mask layouts are BNSS, B1SS, 11SS and SS, of bool or uint8, True =
        # masked: never the (B, 1, 1, S) of a key padding mask, which the kernel rejects.
        assert mask.dtype == torch.bool and mask.dim() == 4
        assert mask.shape[2:] == (lq, lk)
        assert mask.shape[:2] in ((b, h), (b, 1), (1, 1))
    pse = bound.get("pse")
    if pse is not None:  # BNSS, BN1Skv or 1NSS
        assert pse.shape == (b, h, lq, lk)


def test_the_translation_relies_on_the_schema_defaults():
    arguments = {a.name: a for a in release.schema("npu_fusion_attention")}
    # sparse_mode 0 (defaultMask: atten_mask is applied as given, pre/next tokens bound a band)
    # and inner_precise 0 are the defaults npu_attn leaves in place.
    assert arguments["sparse_mode"].default == "0"
    assert arguments["inner_precise"].default == "0"
    # The token window npu_attn passes (diffusers' 65536) is an int the schema takes, narrower
    # than its unbounded default.
    for name in ("pre_tockens", "next_tockens"):
        assert arguments[name].type == "int"
        assert int(arguments[name].default) > npu_backend.TOKEN_WINDOW
    assert arguments["keep_prob"].default == "1."  # keep_prob = 1 - dropout_p
    doc = release.op_doc("npu_fusion_attention")
    assert "取值为1(或True)代表该位不参与计算(被遮蔽)" in doc  # atten_mask: True = masked
    assert "BNSS格式、B1SS格式、11SS格式、SS格式" in doc  # the mask layouts tested above
    assert "BNSD" in doc and "代表缩放系数" in doc  # the layout and scale


def test_the_stand_in_has_the_release_signature():
    """FakeTorchNpu declares the release's leading arguments, in order, with its defaults."""
    fake = inspect.signature(FakeTorchNpu.npu_fusion_attention).parameters
    declared = [p for p in fake.values() if p.name != "self" and p.kind != p.VAR_KEYWORD]
    real = release.schema("npu_fusion_attention")[: len(declared)]
    assert [p.name for p in declared] == [a.name for a in real]
    for param, argument in zip(declared, real):
        if argument.default is None:
            assert param.default is inspect.Parameter.empty, param.name
        elif argument.default == "None":
            assert param.default is None, param.name
        else:
            assert param.default == type(param.default)(float(argument.default)), param.name


def test_a_renamed_argument_is_caught(monkeypatch):
    """The check above fails for a call the release would refuse (shown once, on purpose)."""
    args, kwargs, _ = npu_call(monkeypatch, {})
    renamed = {("keep_probability" if k == "keep_prob" else k): v for k, v in kwargs.items()}
    with pytest.raises(TypeError, match="keep_probability"):
        bind("npu_fusion_attention", args, renamed)
    with pytest.raises(TypeError, match="scale is float, got str"):
        bind("npu_fusion_attention", args, {**kwargs, "scale": "0.5"})


# torch.npu calls the DeviceManager makes (TorchProbe), with the arguments it passes.
TORCH_NPU_CALLS = [
    ("npu/__init__.py", "is_available", ()),
    ("npu/__init__.py", "device_count", ()),
    ("npu/memory.py", "memory_allocated", ("device",)),
    ("npu/memory.py", "memory_reserved", ("device",)),
    ("npu/memory.py", "max_memory_allocated", ("device",)),
    ("npu/memory.py", "empty_cache", ()),
    ("npu/utils.py", "synchronize", ("device",)),
]


@pytest.mark.parametrize(("file", "name", "passed"), TORCH_NPU_CALLS, ids=lambda x: str(x))
def test_the_device_manager_calls_exist_in_torch_npu(file, name, passed):
    function = release.python_function(file, name)
    params = [a.arg for a in function.args.args]
    assert len(params) >= len(passed), (name, params)
    assert params[: len(passed)] == list(passed) or not passed
    # TorchProbe calls it by this name (a rename in npu_attn would fail here too)
    assert name in inspect.getsource(TorchProbe)


def test_hccl_is_the_release_process_group_backend_for_npu():
    from npu_attn.parallel import group

    source = (release.RELEASE / "_init/registry/distributed.py").read_text(encoding="utf-8")
    assert 'register_backend(\n        "hccl"' in source and 'devices=["npu"]' in source
    assert "npu:hccl" in inspect.getsource(group)


def test_the_torchair_backend_npu_attn_builds_exists_in_the_release():
    """npu_attn.compile(backend="torchair"): torchair.CompilerConfig(),
    config.experimental_config.frozen_parameter = True, get_npu_backend(compiler_config=...)."""
    from npu_attn.graph import mode

    assert {"get_npu_backend", "CompilerConfig"} <= release.imported_names(
        "dynamo/torchair/__init__.py"
    )
    factory = release.python_function("dynamo/torchair/npu_fx_compiler.py", "get_npu_backend")
    assert "compiler_config" in [a.arg for a in factory.args.kwonlyargs]
    config = (release.RELEASE / "dynamo/torchair/configs/compiler_config.py").read_text()
    assert "self.experimental_config = _ExperimentalConfig()" in config
    experimental = (release.RELEASE / "dynamo/torchair/configs/experimental_config.py").read_text()
    assert "self.frozen_parameter = OptionValue(False, [True, False])" in experimental
    source = inspect.getsource(mode.torchair_backend)
    assert "config.experimental_config.frozen_parameter = True" in source
    assert "torchair.get_npu_backend(compiler_config=config)" in source


# torch_npu calls the doctor's Ascend section makes (doctor_ascend.py), with their arguments.
DOCTOR_CALLS = [
    ("npu/utils.py", "get_cann_version", ("module",)),
    ("npu/__init__.py", "device_count", ()),
    ("npu/__init__.py", "get_device_name", ("device_name",)),
]


@pytest.mark.parametrize(("file", "name", "passed"), DOCTOR_CALLS, ids=lambda x: str(x))
def test_the_doctor_calls_exist_in_torch_npu(file, name, passed):
    from npu_attn.tools import doctor_ascend

    function = release.python_function(file, name)
    assert [a.arg for a in function.args.args][: len(passed)] == list(passed)
    assert name in inspect.getsource(doctor_ascend)


def test_the_cann_components_the_doctor_asks_for_exist():
    """get_cann_version lives in torch_npu.npu.utils (torch.npu does not re-export it), and
    takes the component names the doctor passes."""
    from npu_attn.tools import doctor_ascend

    assert "get_cann_version" not in release.imported_names("npu/__init__.py")
    doc = inspect.cleandoc(
        release.python_function("npu/utils.py", "get_cann_version").body[0].value.value
    )
    for component in doctor_ascend.CANN_COMPONENTS:
        assert f'\\"{component}\\"' in doc, component
