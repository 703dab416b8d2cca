"""What the CUDA kernels hand to MLX (model/kernels/source.py): their sources without commentary,
the code itself unchanged line for line."""
from __future__ import annotations

import pytest

from mtp_engine.model import kernels
from mtp_engine.model.kernels.source import compact

SOURCES = {"kv": kernels.attn._KV_SOURCE, "attend": kernels.attn._ATTEND_SOURCE,
           "merge": kernels.attn._MERGE_SOURCE, "gdn": kernels.gdn._SOURCE,
           "qmv": kernels.qmv._SOURCE, "mma": kernels.mma.SOURCE, "norm": kernels.norm._SOURCE}


def test_comments_and_indentation_go_and_code_stays():
    src = """
        // a comment line
        const int a = b / 2;   // why
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc += x[i];

    """
    assert compact(src) == "const int a = b / 2;\n#pragma unroll\nfor (int i = 0; i < 4; ++i) acc += x[i];\n"


def test_literals_are_refused():
    with pytest.raises(ValueError, match="literals"):
        compact('printf("a // b");')


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_kernel_source_compacts_to_the_same_code(name):
    src = SOURCES[name]
    out = compact(src)
    assert "//" not in out and len(out) < len(src)
    # the same tokens in the same order once comments are gone
    code = [line.split("//", 1)[0].split() for line in src.splitlines()]
    assert [t for line in code for t in line] == out.split()


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kernel_sources_use_no_math_macros_the_ahead_compiler_lacks(name):
    """MLX's JIT defines INFINITY and NAN for its own kernels; the compiler that builds ours ahead
    in worker processes (model/kernels/nvrtc.py) includes only what the kernels' signatures need. A source
    using them failed there ("identifier INFINITY is undefined": the attention kernels were never
    kept across processes and compiled anew in every first forward); bit patterns say the same."""
    import re

    headers = {"kv": kernels.attn._HEADER, "attend": kernels.attn._HEADER, "mma": kernels.mma.HEADER}
    header = "\n".join(line.split("//", 1)[0] for line in headers.get(name, "").splitlines())  # asm strings
    code = compact(SOURCES[name]) + header
    assert not re.search(r"\b(INFINITY|NAN|HUGE_VALF?)\b", code), name
