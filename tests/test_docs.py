"""The documentation is true to the tree: the code in README.md and docs/ runs, and every relative link in a
Markdown file resolves.

Code blocks carry a language: ``python`` blocks run, each in a fresh namespace; ``bash`` blocks are commands
checked line by line (a ``python -m`` command runs, a ``make`` target must exist in the Makefile, a ``pip
install`` of the checkout must name extras that pyproject.toml defines: building attnx again would take
minutes); ``text`` blocks are output or layout listings. A block of any other kind, or untagged, fails: say
what it is so that it can be checked.
"""

import importlib.util
import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The Markdown files whose code must run: the README and docs/.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Third-party libraries an example may need beyond torch: the example is skipped, saying so, without them.
OPTIONAL = {"transformers": "transformers", "timm": "timm", "open_clip": "open-clip-torch"}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.M | re.S)


def _blocks():
    for path in DOCUMENTS:
        if not path.exists():
            continue
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            name = f"{path.relative_to(ROOT)}:{line}"
            tag = match.group(1) or "untagged"
            yield pytest.param(match.group(1), match.group(2), name, id=f"{name}-{tag}")


BLOCKS = list(_blocks())


def test_the_documents_have_code():
    # Guards the collection itself: a broken fence pattern would silently test nothing.
    assert any(param.values[0] == "python" for param in BLOCKS), "no ```python block found in README.md"


@pytest.mark.parametrize("language, code, where", BLOCKS)
def test_code_block(language, code, where):
    if language == "python":
        run_python(code, where)
    elif language == "bash":
        for command in code.splitlines():
            command = command.split("#", 1)[0].strip()
            if command:
                check_command(command, where)
    elif language != "text":
        pytest.fail(f"{where}: a ```{language or ' block without a language'}: tag it python, bash or text")


def run_python(code: str, where: str):
    for module, package in OPTIONAL.items():
        imported = re.search(rf"^\s*(import|from) {module}\b", code, flags=re.M)
        if imported and not importlib.util.find_spec(module):
            pytest.skip(f"{package} is not installed (from a checkout: pip install '.[models]')")
    # torch's APIs an example relies on that an older torch (the floor, 2.10) lacks: skipped, saying so.
    for name in re.findall(r"torch\.nn\.attention\.(\w+)\(", code):
        if not hasattr(torch.nn.attention, name):
            pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.{name}")
    if re.search(r"^\s*from torch\.nn\.attention\.varlen import", code, flags=re.M):
        from attnx.pytorch import varlen

        if not varlen.AVAILABLE:
            pytest.skip(varlen.REASON)
        from torch.nn.attention.varlen import varlen_attn

        newer = {"window_size", "enable_gqa", "scale", "seqused_k", "block_table"}  # not in torch 2.10's
        missing = newer - set(inspect.signature(varlen_attn).parameters)
        for name in set(re.findall(r"\b(\w+)=", code)) & missing:
            pytest.skip(f"torch {torch.__version__}'s varlen_attn has no {name}")
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def check_command(command: str, where: str):
    words = shlex.split(command)
    if words[:2] == ["python", "-m"]:
        result = subprocess.run(
            [sys.executable, *words[1:]], capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert result.returncode == 0, f"{where}: `{command}` failed:\n{result.stderr[-3000:]}"
    elif words[0] == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        for word in words[1:]:
            if "=" not in word:
                assert word in targets, f"{where}: `{command}`: the Makefile has no target {word!r}"
    elif words[:2] == ["pip", "install"]:
        tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        for word in words[2:]:
            if word.startswith("-"):
                assert word in ("--no-build-isolation", "-e", "--editable"), f"{where}: unchecked flag {word}"
                continue
            match = re.fullmatch(r"\.(?:\[([\w,]+)\])?", word)
            if match is None:  # a package from the index: a build requirement, say
                known = ("setuptools", "wheel", "ninja")
                assert word in known, f"{where}: `{command}`: unknown package {word}"
            else:
                unknown = set(filter(None, (match.group(1) or "").split(","))) - extras
                assert not unknown, f"{where}: `{command}`: pyproject.toml has no extra {sorted(unknown)}"
    else:
        pytest.fail(f"{where}: `{command}`: no check for this command: add one to {__name__}")


# Links: `make test-wheel` runs the suite in a copy of the tree without python/ and setup.py, where links into
# them cannot resolve: they are the checkout's facts, checked by `make test`.
CHECKOUT = (ROOT / "setup.py").exists()
SKIP_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _markdown_files():
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".md"):
                yield pathlib.Path(directory, name)


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lowercased, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", path.read_text())
    slugs = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return slugs


def broken_links(path: pathlib.Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.skipif(not CHECKOUT, reason="no setup.py in this copy of the tree (the installed wheel's run)")
@pytest.mark.parametrize("path", list(_markdown_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links: {broken_links(path)}"


def test_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [missing](nowhere.md) [bad anchor](#other) `[code](x.md)`\n")
    assert broken_links(page) == ["nowhere.md (no such file)", "#other (no heading with that anchor)"]
