"""The golden loss-scale traces (``tests/golden/loss_scale_traces.json``), for both backends."""

from __future__ import annotations

import json
from pathlib import Path

TRACES = json.loads((Path(__file__).parent / "golden" / "loss_scale_traces.json").read_text())[
    "traces"]
IDS = [trace["name"] for trace in TRACES]
