"""A source text's syntax tree, parsed and walked once while a module of source checks runs (test_layout,
test_one_definition: each of their tests walks the trees of the same ~160 files, 0.3-0.5 s per test). The trees
are read, never changed; `parse_once`, a module fixture, drops them when the module ends (some 400,000 nodes that
every later full garbage collection would otherwise walk)."""
from __future__ import annotations

import ast
from functools import lru_cache

import pytest


@lru_cache(maxsize=None)
def parsed(text: str) -> ast.Module:
    """ast.parse(text), the same tree for the same text."""
    return ast.parse(text)


@lru_cache(maxsize=None)
def walked(text: str) -> tuple[ast.AST, ...]:
    """Every node of parsed(text), in ast.walk's order (walking the trees again was most of the checks' time)."""
    return tuple(ast.walk(parsed(text)))


@pytest.fixture(scope="module", autouse=True)
def parse_once():
    yield
    parsed.cache_clear()
    walked.cache_clear()
