"""The README's examples run as written (the sections listed in SECTIONS)."""

import importlib.util
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
SECTIONS = ["## With transformers, timm and open_clip"]
# Third-party libraries an example may need beyond torch: the example is skipped, saying so, without them.
OPTIONAL = {"transformers": "transformers", "timm": "timm", "open_clip": "open-clip-torch"}


def _examples():
    text = README.read_text()
    for title in SECTIONS:
        start = text.index(title)
        end = text.find("\n## ", start + len(title))
        body = text[start:end if end >= 0 else None]
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", body, flags=re.S)):
            yield pytest.param(block, id=f"{title.removeprefix('## ')}-{i}")


@pytest.mark.parametrize("code", list(_examples()))
def test_readme_example_runs(code):
    for module, package in OPTIONAL.items():
        imported = re.search(rf"^\s*(import|from) {module}\b", code, flags=re.M)
        if imported and not importlib.util.find_spec(module):
            pytest.skip(f"{package} is not installed (pip install 'attnx[models]')")
    exec(compile(code, str(README), "exec"), {})
