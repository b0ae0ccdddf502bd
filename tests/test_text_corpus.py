"""kuat.text.corpus: the demo's text, from what every Python ships, read without importing."""

from __future__ import annotations

import inspect
import textwrap

from kuat.text.corpus import DOC_MODULES, demo_corpus, python_docs_corpus, stdlib_docstrings


def _paragraphs(doc: str, min_chars: int = 40) -> list[str]:
    return [p.strip() for p in inspect.cleandoc(doc).split("\n\n") if len(p.strip()) >= min_chars]


def test_stdlib_docstrings_are_the_modules_docstrings_in_source_order():
    got = stdlib_docstrings(modules=("textwrap",))
    # what the imported module says, module docstring first, then its functions' in order
    expected = _paragraphs(textwrap.__doc__)
    for fn in (textwrap.wrap, textwrap.fill, textwrap.shorten, textwrap.dedent):
        expected += _paragraphs(fn.__doc__)
    assert got[: len(_paragraphs(textwrap.__doc__))] == _paragraphs(textwrap.__doc__)
    positions = [got.index(p) for p in expected]  # every one of them, in source order
    assert positions == sorted(positions)
    assert all(len(p) >= 40 and p == p.strip() for p in got)


def test_missing_modules_are_skipped_and_the_corpus_is_deterministic():
    assert stdlib_docstrings(modules=("no_such_module_kuat",)) == []
    assert len(DOC_MODULES) == len(set(DOC_MODULES))
    corpus = demo_corpus()
    assert corpus == demo_corpus()
    topics = python_docs_corpus()
    assert corpus[: len(topics)] == topics
    # ~2x the characters of the topics alone: enough rows of 2048 for the 1% waste target
    assert sum(map(len, corpus)) > 1.8 * sum(map(len, topics))
