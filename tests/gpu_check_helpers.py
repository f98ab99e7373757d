"""Where tools/gpu_check.py is, for tests/test_gpu_check.py and tests/test_cuda_binary.py (the tool is a
script, not a package module: conftest.py's `gpu_check` fixture loads it from its path). A tree without tools/
(the installed wheel's test copy) skips those tests."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")

requires_tool = pytest.mark.skipif(not os.path.exists(TOOL), reason="tools/gpu_check.py is not in this tree")
