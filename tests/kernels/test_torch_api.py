"""The packages use only torch APIs checked to exist in torch 2.11, the GPU machines' torch (CI runs a newer one).

torch_2_11_api.txt beside this file lists every torch name the packages use, each looked up in torch 2.11.0's wheel
(`python3 -m pip download torch==2.11.0 --no-deps`, a zip): the `torch.*` attributes they reach (`torch.cuda.graph`,
`F.scaled_dot_product_attention`, ...), the keyword arguments they pass to those (`...(enable_gqa=)`), and the
Tensor attributes among the attribute names they read (`Tensor.view`). The CUDA path cannot be told apart from the
CPU path by reading the code, so every module of the packages counts.

A use the list lacks fails the test until someone finds it in torch 2.11's sources (the function stubs are in
torch/_C/_VariableFunctions.pyi, Tensor's in torch/_C/__init__.pyi, the rest in the module's .py) and adds it, or
guards it. Only names are checked: a changed meaning is for a person to read.
"""
import ast
from pathlib import Path

import torch

from tests.conftest import REPO_ROOT

PACKAGES = ("zoo", "attention", "ssm", "cache", "kernels", "harness")
CHECKED = Path(__file__).with_name("torch_2_11_api.txt")


def torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch or to something in it, e.g. {"F": "torch.nn.functional", "torch": "torch"}."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] == "torch":
                    aliases[name.asname or "torch"] = name.name if name.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "torch":
            for name in node.names:
                aliases[name.asname or name.name] = f"{node.module}.{name.name}"
    return aliases


def dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`F.pad` as "torch.nn.functional.pad"; None for what is not reached from torch by attributes alone."""
    attributes = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(attributes)])


def uses(tree: ast.Module, tensor_attributes: set[str]) -> set[str]:
    aliases = torch_aliases(tree)
    found = set(aliases.values())
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if id(node) not in inner and (name := dotted(node, aliases)):  # the whole chain, not its prefixes
                found.add(name)
            if node.attr in tensor_attributes:
                found.add(f"Tensor.{node.attr}")
        elif isinstance(node, ast.Call) and (name := dotted(node.func, aliases)):
            found.update(f"{name}({keyword.arg}=)" for keyword in node.keywords if keyword.arg)
    return found


def package_uses() -> dict[str, set[str]]:
    """Each torch name the packages use, with the files that use it."""
    tensor_attributes = set(dir(torch.Tensor)) - set(dir(object))  # __setattr__ and the like are Python's
    where: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for name in uses(ast.parse(path.read_text()), tensor_attributes):
                where.setdefault(name, set()).add(str(path.relative_to(REPO_ROOT)))
    return where


def checked_names() -> set[str]:
    lines = (line.strip() for line in CHECKED.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


OWN_OPS = "torch.ops.archzoo"  # the namespace of the ops the packages register themselves (kernels/), in any torch


def test_every_torch_api_the_packages_use_is_in_torch_2_11():
    unchecked = {name: files for name, files in package_uses().items()
                 if name not in checked_names() and name != OWN_OPS and not name.startswith(OWN_OPS + ".")}
    listing = "\n".join(f"  {name}  ({', '.join(sorted(files))})" for name, files in sorted(unchecked.items()))
    assert not unchecked, (f"torch APIs not yet checked against torch 2.11 (see {CHECKED.name}'s header); find "
                           f"each in torch 2.11.0's wheel and add it there, or guard it:\n{listing}")
