"""pytest set-up for the upstream patches' tests: ``harness`` importable by bare name."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
