"""tests/workers/test_fuzz_modes.py draws its cases from the route, gateway and raw HTTP fuzz modules
of tests/server and tests/http: their folders go on the import path here, so that it collects when
run on its own as well as beside them."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1] / floor) for floor in ("server", "http")]
