"""tests/faults: fault injection against real processes on 127.0.0.1 (run alone with
``python -m pytest tests/faults``). Each test writes its RELIABILITY.md row when
``KVROUTE_RELIABILITY_OUT`` names a folder (``python -m bench.reliability_table`` renders
them)."""

from __future__ import annotations

import sys
from pathlib import Path

# e2e_procs (start ``python -m kvroute_cli ...``, read its ``listening on`` line, always kill)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
