"""The text a tuned lens is fitted on and judged on: docstrings of Python's own standard library, read from the
interpreter that runs (PSF-licensed prose and examples every machine with Python has, so a fit can be redone
anywhere; the project ships no corpus). Two disjoint sets of modules: TRAIN_MODULES to fit, HELDOUT_MODULES to
judge, so the held-out KL is measured on text the fit never saw.

    texts = docstrings("train")               # list[str], each at least MIN_CHARS characters
    corpus_facts("train")                     # {"corpus", "modules", "python", "sha256"}: what the recipe records
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import platform

from engine.errors import InputError

TRAIN_MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib", "re", "string",
                 "textwrap", "typing", "datetime", "decimal", "fractions", "statistics", "random", "shutil",
                 "subprocess", "threading", "logging", "csv")
HELDOUT_MODULES = ("email.message", "http.client", "urllib.parse", "zipfile", "tarfile", "sqlite3", "xml.dom.minidom",
                   "unittest.case", "difflib", "heapq", "bisect", "calendar")
MIN_CHARS = 200          # shorter docstrings are signatures and one-liners: little context for a lens to read
SPLITS = {"train": TRAIN_MODULES, "heldout": HELDOUT_MODULES}


def _module_docs(name: str) -> list[str]:
    """The module's docstring and its public members' (classes, functions, their methods), in definition order."""
    mod = importlib.import_module(name)
    out, seen = [], set()

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= MIN_CHARS and doc not in seen:
            seen.add(doc)
            out.append(doc)

    add(mod)
    for attr, obj in vars(mod).items():
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        add(obj)
        if inspect.isclass(obj):
            for m_name, member in vars(obj).items():
                if not m_name.startswith("_"):
                    add(member)
    return out


def docstrings(split: str) -> list[str]:
    """Every docstring of MIN_CHARS or more of the split's modules (see SPLITS), in a fixed order."""
    if split not in SPLITS:
        raise InputError(f"unknown corpus split {split!r}; the splits are {', '.join(SPLITS)}")
    texts = [d for name in SPLITS[split] for d in _module_docs(name)]
    if not texts:
        raise InputError(f"no docstring of {MIN_CHARS}+ characters in the {split} modules (python -OO strips them)")
    return texts


def corpus_facts(split: str, texts: list[str] | None = None) -> dict:
    """What a recipe records of the corpus: its source, modules, the Python that supplied the docstrings and the
    SHA-256 of the texts (a refit on another Python can tell its text differed)."""
    texts = docstrings(split) if texts is None else texts
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()
    return {"corpus": f"python-stdlib-docstrings:{split}", "modules": list(SPLITS[split]),
            "python": platform.python_version(), "sha256": digest}
