"""One rule for where a rank's tensors live, checked without a GPU.

On a GPU node every tensor that reaches a collective must be on the rank's GPU (NCCL has
no CPU path: "No backend type associated with device type cpu"), and a tensor made on the
CPU beside parameters on `cuda:0` breaks the first operation that mixes them. On a CPU
machine both mistakes are invisible: every tensor is on the CPU anyway. So the rule is
checked where a CPU can check it, in the source: every tensor the package makes with a
factory (`torch.zeros`, `torch.tensor`, ...) names its device, either the rank's (the
parameters', `rank_device()`) or, where the CPU is meant, "cpu" explicitly. A factory call
without `device=` is the bug this test finds; `*_like` factories and `.to(...)` inherit or
name the device and are fine.
"""

import ast
from pathlib import Path

import shardlab

FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand",
             "randint", "eye", "linspace", "as_tensor", "empty_strided", "randperm"}
PACKAGE = Path(shardlab.__file__).parent


def factory_calls_without_device(source: str):
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            yield node.lineno, f"torch.{node.func.attr}"


def test_every_tensor_the_package_makes_names_its_device():
    found = [f"{path.relative_to(PACKAGE)}:{line}: {call}(...) without device="
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, call in factory_calls_without_device(path.read_text())]
    assert not found, ("tensors made without a device (on a GPU node they land on the CPU): "
                       + "; ".join(found))


def test_the_check_finds_the_bug_it_is_for():
    bad = "import torch\nflat = torch.zeros(10, dtype=torch.float32)\n"
    good = ("import torch\nflat = torch.zeros(10, device=p.device)\n"
            "y = torch.zeros_like(x)\nz = x.new_zeros(3)\n")
    assert list(factory_calls_without_device(bad)) == [(2, "torch.zeros")]
    assert list(factory_calls_without_device(good)) == []
