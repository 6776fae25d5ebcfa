#!/usr/bin/env bash
# The parity tests under other versions of torch: each VERSION gets its own virtual
# environment (.venv-torch-VERSION), torch==VERSION from the package index, the course's
# runtime dependencies, and the course's code from this checkout; then the tests that hold
# our strategies against PyTorch's own DDP, ZeroRedundancyOptimizer and fully_shard run
# under it.
#
#   bash tools/torch_versions.sh              # the floor the README claims, and the newest
#   bash tools/torch_versions.sh floor        # the floor alone (what CI runs)
#   bash tools/torch_versions.sh 2.10.0       # any other
#   bash tools/torch_versions.sh --install-only floor   # the environment, no tests
#
# CI runs it for the floor. Versions other than 2.13 come from the index as full builds
# (with CUDA libraries, several GB); they run on a CPU all the same.
set -euo pipefail
cd "$(dirname "$0")/.."

FLOOR=2.9.1     # the oldest torch the parity tests pass under on a CPU (the README says why not 2.6-2.8)
NEWEST=2.15.0   # the newest the index served when this was last checked
# the references that change between versions: ZeroRedundancyOptimizer and fully_shard
PARITY_TESTS=(tests/test_zero.py tests/test_fsdp.py tests/test_fsdp_knobs.py)

install_only=false
if [ "${1:-}" = "--install-only" ]; then install_only=true; shift; fi
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(floor newest)
versions=("${versions[@]/#floor/$FLOOR}")
versions=("${versions[@]/#newest/$NEWEST}")

# The package's own runtime dependencies and its models' (read from pyproject.toml, so that
# a dependency added there is installed here too), torch aside; no book tools, no DeepSpeed.
mapfile -t DEPENDENCIES < <(python3 - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["models"]:
    if not requirement.startswith("torch"):
        print(requirement)
PY
)

for version in "${versions[@]}"; do
    venv=".venv-torch-$version"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        # no cache: the wheels would otherwise be kept a second time beside the venv
        "$venv/bin/pip" install -q --no-cache-dir "torch==$version"
    fi
    # (quick when they are there already) the dependencies and the test tools
    "$venv/bin/pip" install -q --no-cache-dir "${DEPENDENCIES[@]}" pytest pytest-timeout nbformat
    $install_only && continue
    echo "== parity tests under torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
    # this checkout's code, not an installed copy
    PYTHONPATH="$PWD/code" "$venv/bin/python" -m pytest "${PARITY_TESTS[@]}" \
        -q -p no:cacheprovider
done
