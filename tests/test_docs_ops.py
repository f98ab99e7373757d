"""docs/ops.md is what docs/generate_ops.py makes of the docstrings, and every public callable's docstring
documents exactly its parameters, so that a new parameter without a doc fails here."""

import difflib
import importlib.util
import inspect
import pathlib

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
GENERATOR = DOCS / "generate_ops.py"


@pytest.fixture(scope="module")
def generator():
    """docs/generate_ops.py as a module. The installed wheel's test run has a copy of the tree that holds
    tests/ but not docs/: there is then neither a reference to compare nor the parser of the docstrings."""
    if not GENERATOR.exists():
        pytest.skip("no docs/generate_ops.py in this copy of the tree (it holds tests/ but not docs/)")
    spec = importlib.util.spec_from_file_location("generate_ops", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ops_md_is_up_to_date(generator):
    expected = generator.generate()
    actual = generator.OUTPUT.read_text() if generator.OUTPUT.exists() else ""
    if actual != expected:
        diff = "".join(difflib.unified_diff(
            actual.splitlines(keepends=True), expected.splitlines(keepends=True), "docs/ops.md",
            "from the docstrings", n=1))
        pytest.fail(f"docs/ops.md is out of date: run python docs/generate_ops.py\n{diff[:4000]}")


def test_generation_is_deterministic(generator):
    assert generator.generate() == generator.generate()


def test_public_callables_are_found(generator):
    # The discovery itself: a callable it missed would be neither documented nor checked below.
    names = {entry.name for entry in generator.public_entries()}
    for name in ("attnx.linear", "attnx.attention", "attnx.attention_backward", "attnx.mha",
                 "attnx.ops.draw_dropout_seed", "attnx.functional.multi_head_attention_forward",
                 "attnx.nn.MultiheadAttention", "attnx.nn.MultiheadAttention.forward", "attnx.convert",
                 "attnx.revert", "attnx.reference.attention", "attnx.reference.mha",
                 "attnx.reference.key_range_mask", "attnx.reference.dropout_keep_mask"):
        assert name in names


def test_docstrings_document_exactly_their_parameters(generator):
    """Args: names every parameter once, in signature order, and nothing else; the summary is one line."""
    problems = []
    for entry in generator.public_entries():
        docstring = inspect.getdoc(entry.obj) or ""
        lines = docstring.splitlines()
        if not lines or (len(lines) > 1 and lines[1].strip()):
            problems.append(f"{entry.name}: the summary is not one line followed by a blank line")
        if inspect.isclass(entry.obj):
            continue  # the constructor is torch's; the methods are entries of their own
        documented = [name for name, _ in generator.parse(entry.obj.__doc__).args]
        expected = [p.name for p in generator.parameters(entry)]
        if documented != expected:
            problems.append(f"{entry.name}: Args: documents {documented}, the signature has {expected}")
    assert not problems, "\n".join(problems)
