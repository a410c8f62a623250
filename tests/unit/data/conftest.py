"""Fixtures for the data tests."""

from __future__ import annotations

import pytest

from megatron_prune.data.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return load_tokenizer("tiny")
