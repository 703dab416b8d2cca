"""mlx-lm's qwen3_5 model built at one of our configurations' shapes (random weights), and its
decode step timed: the peer every speed benchmark compares against. mlx-lm is optional: `build`
returns None when it is not importable."""
from __future__ import annotations

import statistics
import sys
import time
import types

import mlx.core as mx

from mtp_engine.model.config import Qwen35Config


class _Absent:
    """What a stand-in hands out: unusable (nothing of these packages may run in a benchmark)."""

    def __init__(self, *a, **k):
        raise RuntimeError("a hub package is not installed here (a benchmark's import stand-in was used)")

    @classmethod
    def from_pretrained(cls, *a, **k):
        cls()

    @classmethod
    def register(cls, *a, **k):  # mlx-lm registers its own tokenizer class at import
        pass


def _stand_ins() -> None:
    """`transformers` and `huggingface_hub` as modules holding the names mlx-lm imports at module
    level (to load tokenizers and files from the hub), each unusable. The GPU machine has neither
    (their wheels with dependencies are ~34 MB, more than a staging call carries); our benchmarks
    build mlx-lm's model at our shape and call its own decode loops with token ids, so nothing of
    them runs."""
    absent = lambda *a, **k: _Absent()  # noqa: E731
    names = {"transformers": ["AutoTokenizer", "AutoConfig", "PreTrainedTokenizer", "PreTrainedTokenizerFast"],
             "transformers.tokenization_utils_base": ["PreTrainedTokenizerBase"],
             "huggingface_hub": ["snapshot_download", "scan_cache_dir"]}
    for module, attrs in names.items():
        m = types.ModuleType(module)
        for a in attrs:
            setattr(m, a, type(a, (_Absent,), {}) if a[0].isupper() else absent)
        if sys.modules.get(module) is None:  # absent (or blocked)
            sys.modules[module] = m
    sys.modules["transformers"].tokenization_utils_base = sys.modules["transformers.tokenization_utils_base"]


def import_mlx_lm(stand_ins: bool = False) -> bool:
    """Whether mlx-lm imports here; where only `transformers` / `huggingface_hub` are missing (the
    GPU machine), with unusable stand-ins for them (`_stand_ins`), said on stderr."""
    try:
        import mlx_lm  # noqa: F401
        return True
    except ImportError as e:
        missing = e.name
        if missing not in ("transformers", "huggingface_hub") or stand_ins:
            print(f"mlx-lm not available: {e}", file=sys.stderr)
            return False
        for name in [m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm.")]:
            del sys.modules[name]  # the half-imported package, imported again below
    _stand_ins()
    print(f"mlx-lm: {missing} is not installed here; unusable stand-ins are imported in its place "
          "(tokenizer and hub loading only; mlx-lm's model and decode loops are its own)", file=sys.stderr)
    return import_mlx_lm(stand_ins=True)


# mlx-lm's module paths -> the GGUF tensor names a per-tensor layout is given in
_GGUF_NAMES = (("self_attn.v_proj", "attn_v"), ("linear_attn.in_proj_qkv", "attn_qkv"),
               ("mlp.switch_mlp.down_proj", "ffn_down_exps"), ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
               ("mlp.down_proj", "ffn_down"))


def gguf_name(path: str) -> str:
    """The GGUF tensor name of an mlx-lm module path ("model.layers.3.self_attn.v_proj" ->
    "blk.3.attn_v.weight"; the head "output.weight"); others keep their path."""
    if path == "lm_head":
        return "output.weight"
    parts = path.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        for mine, theirs in _GGUF_NAMES:
            if rest == mine:
                return f"blk.{parts[2]}.{theirs}.weight"
    return path


def build(cfg: Qwen35Config, bits: int | None = 4, tie: bool | None = None, bits_of=None):
    """The dense (qwen3_5_text) or MoE (qwen3_5_moe_text) model at cfg's shape, quantized to `bits`
    with group 32 (None: float32), materialised layer by layer. `bits_of(gguf tensor name)`: each
    matrix's bits instead (a file's mix, `harness.q4_k_m_bits`)."""
    if not import_mlx_lm():
        return None
    try:
        import mlx.nn as nn
        from mlx_lm.models import qwen3_5
    except Exception as e:  # an mlx-lm without this architecture
        print(f"mlx-lm not available: {e}", file=sys.stderr)
        return None
    moe = getattr(cfg, "n_expert", 0) > 0
    kw = dict(model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", hidden_size=cfg.hidden_size,
              intermediate_size=cfg.expert_ffn_size if moe else cfg.ffn_size[0],
              num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
              rms_norm_eps=cfg.eps, vocab_size=cfg.vocab_size, linear_num_value_heads=cfg.ssm_value_heads,
              linear_num_key_heads=cfg.ssm_key_heads, linear_key_head_dim=cfg.ssm_key_dim,
              linear_value_head_dim=cfg.ssm_value_dim, linear_conv_kernel_dim=cfg.conv_kernel,
              head_dim=cfg.head_dim, full_attention_interval=4, partial_rotary_factor=cfg.n_rot / cfg.head_dim,
              rope_theta=cfg.rope_base, max_position_embeddings=8192)
    if moe:
        kw.update(num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
                  moe_intermediate_size=cfg.expert_ffn_size, shared_expert_intermediate_size=cfg.shared_ffn_size)
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    model = qwen3_5.TextModel(qwen3_5.TextModelArgs(**kw))
    if bits and bits_of is not None:
        nn.quantize(model, group_size=32, bits=bits,
                    class_predicate=lambda path, m: hasattr(m, "to_quantized") and
                    {"group_size": 32, "bits": bits_of(gguf_name(path))})
    elif bits:
        nn.quantize(model, group_size=32, bits=bits)
    for layer in model.layers:  # the float init of all MoE experts at once would not fit
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def step_ms(model, prompt_len: int = 64, steps: int = 40) -> float:
    """Median ms of one greedy decode step (forward, argmax, host read) after a prompt."""
    cache = model.make_cache()
    mx.eval(model(mx.array([list(range(100, 100 + prompt_len))]), cache=cache))
    tok = mx.array([[5]])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[None]
        tok.item()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[min(3, steps - 1):])


def build_and_time(cfg: Qwen35Config, prompt_len: int = 64, steps: int = 40) -> float | None:
    """`step_ms` of a freshly built 4-bit model at cfg's shape; None without mlx-lm."""
    model = build(cfg)
    return None if model is None else step_ms(model, prompt_len, steps)


def generate_step_tps(model, prompt_len: int = 64, tokens: int = 128) -> float | None:
    """Decode tok/s of mlx-lm's own pipelined loop (`generate_step`, greedy, async_eval of the next
    step before the host reads the current token): tokens after the first over the time after it."""
    if model is None:
        return None
    from mlx_lm.generate import generate_step

    prompt = mx.array(list(range(100, 100 + prompt_len)))
    t_first, n = None, 0
    for _tok, _ in generate_step(prompt, model, max_tokens=tokens):
        if t_first is None:
            t_first = time.perf_counter()
        else:
            n += 1
    return n / (time.perf_counter() - t_first) if n else None
