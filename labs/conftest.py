"""nbval re-runs the labs on the reader's machine: compare their outputs under the course's
rule for stored outputs (tools/stored_outputs.py), on the CPU, where they were stored."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import stored_outputs  # noqa: E402

stored_outputs.install()
