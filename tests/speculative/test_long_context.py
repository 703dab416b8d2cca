"""draft-mtp at a 32k-token context on a CUDA GPU (the CPU's check is test_spec.py's 4096-token
one): greedy output equal to plain decoding, through the long-context attention kernel, the
prefill's dequantized products and 4096-token chunks, and the head's own long cache."""
from __future__ import annotations

import pytest

from tests.conftest import TINY, need
from mtp_engine import generate, load
from mtp_engine.cli.bench import synthetic_prompt

gpu_only = pytest.mark.gpu  # a 32k prefill of even the tiny model is minutes on the CPU


@gpu_only
def test_greedy_parity_at_a_32k_token_context():
    m = load(need(TINY / "qwen35-mtp-tiny-Q4_K_M.gguf"), max_context=32768 + 64)  # past its trained 4096
    ids = synthetic_prompt(m.tokenizer, 32768)
    base = generate(ids, m, max_tokens=24, ignore_eos=True).token_ids
    for n_max in (3, "auto"):
        r = generate(ids, m, max_tokens=24, ignore_eos=True, spec="draft-mtp", n_max=n_max)
        assert r.token_ids == base, n_max
