"""A real text corpus that every Python ships, and a tokenizer trained on it: the data of
``kuat demo text``, the text benchmarks and the tests (nothing is downloaded).

Two sources, both shipped with every CPython (so the text is fixed by the Python version):

* :func:`python_docs_corpus`: the Python documentation's topic pages that ``pydoc`` serves
  offline (``pydoc_data.topics``: about 465 KB of English prose and code in ~2,000
  paragraphs, ~98,000 tokens with the demo's tokenizer);
* :func:`stdlib_docstrings`: the docstrings of the standard library's most documented
  pure-Python modules (:data:`DOC_MODULES`), read from their source with :mod:`ast` (nothing
  is imported): about 450 KB more.

:func:`demo_corpus` is both: ~2.3x the tokens of the topics alone, so that at rows of 2,048 the
last, partial row of an epoch (padding no packer can avoid) is under 1% of the rows' slots.
"""

from __future__ import annotations

__all__ = [
    "python_docs_corpus",
    "stdlib_docstrings",
    "demo_corpus",
    "train_bpe",
    "chat_samples",
    "EOS",
    "DOC_MODULES",
]

EOS = "<|endoftext|>"

# Standard-library modules with the most docstring prose (measured on CPython 3.11), present in
# CPython 3.10 to 3.14: a fixed list, so the corpus does not depend on which other files an
# installation ships (Debian moves tests out, for example).
DOC_MODULES = (
    "_pydecimal",
    "_pyio",
    "argparse",
    "ast",
    "bdb",
    "codecs",
    "configparser",
    "difflib",
    "doctest",
    "enum",
    "ftplib",
    "imaplib",
    "inspect",
    "ipaddress",
    "optparse",
    "os",
    "pdb",
    "pickletools",
    "platform",
    "pydoc",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "ssl",
    "statistics",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "traceback",
    "turtle",
    "typing",
    "uuid",
)


def python_docs_corpus(min_chars: int = 40) -> list[str]:
    """The paragraphs (blank-line separated) of ``pydoc_data.topics`` with at least
    ``min_chars`` characters, topics in name order (deterministic)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            if len(para.strip()) >= min_chars:
                out.append(para.strip())
    return out


def stdlib_docstrings(min_chars: int = 40, modules=DOC_MODULES) -> list[str]:
    """The paragraphs (blank-line separated, at least ``min_chars`` characters) of the
    docstrings of ``modules`` (standard-library module names, whose ``.py`` files are read from
    ``sysconfig``'s ``stdlib`` directory and parsed with :mod:`ast`, not imported): modules in
    the given order, each module's docstrings (module, classes, functions) in source order.
    A module this Python does not ship as source is skipped (the corpus then is smaller).

    Takes about a second (parsing ~1.9 MB of source)."""
    import ast
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    out = []
    for name in modules:
        try:
            tree = ast.parse((root / f"{name}.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        nodes = sorted(
            (n for n in ast.walk(tree) if isinstance(n, kinds)),
            key=lambda n: getattr(n, "lineno", 0),  # (the module has none: it comes first)
        )
        for node in nodes:
            for para in (ast.get_docstring(node) or "").split("\n\n"):
                if len(para.strip()) >= min_chars:
                    out.append(para.strip())
    return out


def demo_corpus() -> list[str]:
    """The corpus of ``kuat demo --text``: :func:`python_docs_corpus` then
    :func:`stdlib_docstrings` (about 930 KB of text in ~6,000 paragraphs on CPython 3.11)."""
    return python_docs_corpus() + stdlib_docstrings()


def train_bpe(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``, with :data:`EOS` as
    token 0. Takes about a second on the whole corpus.

    Raises:
        kuat.MissingDependencyError: the ``tokenizers`` package is missing (an
            ``ImportError`` naming ``pip install 'kuat[text]'``).
    """
    from kuat.errors import require

    require("tokenizers", extra="text", needed_for="kuat.text.corpus.train_bpe")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def chat_samples(texts: list[str]) -> list[dict]:
    """SFT conversations built from paragraphs: a system prompt, a user question naming the
    paragraph's first words, and the paragraph as the assistant's answer."""
    out = []
    for text in texts:
        topic = " ".join(text.split()[:4])
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You answer questions about Python."},
                    {"role": "user", "content": f"Explain: {topic}"},
                    {"role": "assistant", "content": text},
                ]
            }
        )
    return out
