"""The real torch_npu 2.13.0 release, read as files (its op schemas, docs and Python sources),
never imported: importing it needs Ascend's CANN libraries. scripts/setup.sh downloads the wheel
and unpacks the files used here into build/torch_npu_release (``python torch_npu_release.py
unpack WHEEL_DIR DEST``), outside every import path."""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
RELEASE = ROOT / "build" / "torch_npu_release" / "torch_npu"
VERSION = "2.13.0"
SCHEMAS = "csrc/aten/npu_native_functions_by_codegen.yaml"
# What the tests read: the op schemas and docs, torch.npu's Python API, the hccl registration
# and torchair's backend factory.
FILES = (
    SCHEMAS,
    "_op_plugin_docs.py",
    "npu/__init__.py",
    "npu/memory.py",
    "npu/utils.py",
    "npu/random.py",
    "_init/registry/distributed.py",
    "dynamo/torchair/__init__.py",
    "dynamo/torchair/npu_fx_compiler.py",
    "dynamo/torchair/configs/compiler_config.py",
    "dynamo/torchair/configs/experimental_config.py",
)


def available() -> Optional[str]:
    """None when the release is unpacked, else why not (the skip reason)."""
    if (RELEASE / SCHEMAS).is_file():
        return None
    return f"torch_npu {VERSION} is not unpacked in {RELEASE.parent}: run scripts/setup.sh"


@dataclass(frozen=True)
class Argument:
    type: str  # e.g. "Tensor?", "int", "float", "str", "int[]?"
    name: str
    default: Optional[str]  # the schema's text, e.g. "2147483647", "None"
    keyword_only: bool


def schema(op: str) -> list[Argument]:
    """The arguments of ``op``'s native function schema in the release."""
    text = (RELEASE / SCHEMAS).read_text(encoding="utf-8")
    match = re.search(rf"func: {re.escape(op)}\((.*?)\) ->", text)
    if match is None:
        raise KeyError(f"{op} is not in torch_npu {VERSION}'s schemas")
    arguments, keyword_only = [], False
    for part in match.group(1).split(", "):
        if part == "*":
            keyword_only = True
            continue
        declaration, _, default = part.partition("=")
        type_, name = declaration.rsplit(" ", 1)
        arguments.append(Argument(type_, name, default or None, keyword_only))
    return arguments


def op_doc(op: str) -> str:
    """The release's documentation of ``op`` (torch_npu/_op_plugin_docs.py)."""
    text = (RELEASE / "_op_plugin_docs.py").read_text(encoding="utf-8")
    start = text.index(f'"{op}",')
    return text[start : text.index("_add_torch_npu_docstr(", start)]


def python_function(relative: str, name: str) -> ast.FunctionDef:
    """The ``def name`` of one of the release's Python files (top level or in a class)."""
    tree = ast.parse((RELEASE / relative).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise KeyError(f"torch_npu/{relative} has no function {name}")


def imported_names(relative: str) -> set[str]:
    """Names a release file imports at its top level (what its package exports)."""
    tree = ast.parse((RELEASE / relative).read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def unpack(wheel_dir: str, dest: str) -> None:
    wheels = sorted(Path(wheel_dir).glob(f"torch_npu-{VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"no torch_npu {VERSION} wheel in {wheel_dir}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in FILES:
            wheel.extract(f"torch_npu/{name}", dest)


if __name__ == "__main__":
    if sys.argv[1:2] != ["unpack"] or len(sys.argv) != 4:
        raise SystemExit("usage: torch_npu_release.py unpack WHEEL_DIR DEST")
    unpack(sys.argv[2], sys.argv[3])
