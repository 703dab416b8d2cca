"""Python API: `load`, `generate`, `stream_generate`."""
from __future__ import annotations

import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from .chat import tool_calls
from .batching import BatchScheduler, batch_scheduler, batchable, stream_batched
from .constraint import Constraint
from .errors import MTPEngineError
from .generation.loop import Chunk, run
from .generation.profiler import Profiler
from .generation.prompt_cache import PromptCache
from .generation.sampling import SamplerConfig
from .model.loaded import Model
from .model.loader import load_gguf
from .model.memory import check_fits, estimate
from .options import EngineOptions, keep_mlx_kernels_in, mlx_kernel_cache_dir, model_path_from_env
from .request.keywords import keyword_signature, request_from_keywords
from .request.prepare import Prepared, chat_template_note, make_decoder, prepare
from .request.request import GenerationRequest
from .speculative.config import SPEC_METHODS, SpecConfig
from .threads import engine_thread, evaluate_all, release_at_exit, run_on_engine_thread
from .tokenizer.tokenizer import Tokenizer

SPEC_TYPES = SPEC_METHODS
DEFAULT_MODEL_NAME = "qwen35-mtp-code-Q4_K_M.gguf"


def default_model_path() -> Path:
    """$MTP_ENGINE_MODEL, else the model shipped in the checkout's `models/` folder."""
    env = model_path_from_env()
    if env:
        return Path(env)
    for base in (Path(__file__).resolve().parent.parent, Path.cwd()):
        p = base / "models" / DEFAULT_MODEL_NAME
        if p.exists():
            return p
    raise MTPEngineError(f"no model given and no default model found (looked for models/{DEFAULT_MODEL_NAME} "
                         "in the checkout and the current directory; set MTP_ENGINE_MODEL or pass -m)",
                         field="model")


@dataclass
class GenerationResult:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: dict
    logprobs: list[dict] | None = None  # per token, when asked for (see Sampler.token_logprobs)
    tool_calls: list[dict] = field(default_factory=list)  # with `tools`: the calls the text holds (OpenAI's shape)

    @classmethod
    def collect(cls, chunks: Iterator[Chunk], prompt_ids: list[int], logprobs: bool = False) -> "GenerationResult":
        """The result of a whole stream (`prompt_ids` may fill while the stream starts)."""
        text, tokens = [], []
        lps: list[dict] | None = [] if logprobs else None
        last = None
        for chunk in chunks:
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if lps is not None and chunk.logprobs:
                lps.extend(chunk.logprobs)
            last = chunk
        return cls("".join(text), prompt_ids, tokens, last.finish_reason, last.stats, lps, last.tool_calls or [])

    def to_json(self) -> dict:
        out = {"text": self.text, "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason, "stats": self.stats}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


DEFAULT_MAX_CONTEXT = 32768


@run_on_engine_thread
def load(path: str | os.PathLike | None = None, exact: bool = False, load_mtp: bool = True,
         max_context: int | None = None, quantize: str | int | None = None, distributed: str | None = None,
         group=None, distributed_timeout: float = 60.0, *,
         options: EngineOptions | None = None, progress: Callable[[int, int], None] | None = None,
         parallel: int | None = None) -> Model:
    """Loads a Qwen3.5 GGUF file (default: the model in `models/`) or an HF checkpoint folder
    (config.json + safetensors, or a folder written by `mtp-engine convert`). `exact=True` keeps
    Q6_K tensors in float32 so every weight equals llama.cpp's dequantization. `quantize` (folders
    only: `4`, `8`, `"4g32"`, `"4g64,output=8g64,mtp=float"`, a `QuantSpec`; see
    `mtp_engine.model.hf.QuantSpec`) quantizes float matrices as they are read; unquantized ones
    keep their dtype (bf16 stays bf16). `max_context` caps the context a generation may use
    (default: the model's, up to 32768 positions); the memory check assumes it. Refuses
    (MTPEngineError) a model whose predicted memory (`mtp_engine.model.memory.estimate`) for that context
    exceeds what is available. The returned model may be used from any thread (every array it
    holds is evaluated here); generations in several threads at once are independent.

    `distributed` ("tp" or "pp"): this process loads only its rank's share of the GGUF model, over
    `group` (default: the processes `mlx.launch` started); every rank then runs the same
    generations; a peer silent for `distributed_timeout` seconds ends the run (docs/distributed.md).

    `options` (`EngineOptions`: compiled steps, kernels, row padding, cache folder, memory limit)
    are kept on the model (`model.options`); fields left None take the environment's defaults.
    `progress(done, total)` is called as the model's blocks load.

    `parallel` N > 1: generations of several threads share batched steps, up to N sequences in one
    forward (`batching`, `model.scheduler`; draft-mtp ones draft and verify together when the
    model has an MTP head); without it they take turns."""
    if parallel is not None and (not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1):
        raise MTPEngineError(f"expected an integer >= 1, found {parallel!r}", field="parallel")
    m = _load(path, exact, load_mtp, max_context, quantize, distributed, group, distributed_timeout, options,
              progress)
    if parallel is not None and parallel > 1:
        if m.comm is not None:
            raise MTPEngineError("not supported with a distributed model", field="parallel")
        m = replace(m, scheduler=batch_scheduler(m, parallel))
    return m


def _load(path, exact, load_mtp, max_context, quantize, distributed, group, distributed_timeout, options,
          progress) -> Model:
    t0 = time.perf_counter()
    if options is not None and not isinstance(options, EngineOptions):
        raise MTPEngineError(f"expected EngineOptions, found {type(options).__name__}", field="options")
    opts = (options if options is not None else EngineOptions()).resolve()
    if path is not None and not isinstance(path, (str, os.PathLike)):  # bytes and numbers included
        raise MTPEngineError(f"expected a path (a string or os.PathLike) to a GGUF file or a checkpoint folder, "
                             f"found {type(path).__name__} {path!r:.60}", field="path")
    p = Path(path) if path is not None else default_model_path()
    _persist_kernel_cache(opts.cache_path)  # before the first CUDA kernel is compiled
    if max_context is not None and (not isinstance(max_context, int) or isinstance(max_context, bool)
                                    or max_context < 1):
        raise MTPEngineError(f"expected a positive integer, found {max_context!r}", field="max_context")
    if distributed is not None:
        from .distributed.engine import load_model
        m = load_model(p, distributed, group, distributed_timeout, exact, load_mtp, max_context,
                       DEFAULT_MAX_CONTEXT, t0)
        if options is not None:
            m.model.use(opts)
        return m
    _prepare_mlx_modules(p)  # in worker processes, while the weights load
    if p.is_dir():
        return _load_checkpoint(p, quantize, load_mtp, max_context, t0, opts, progress)
    if quantize is not None:
        raise MTPEngineError("quantize= applies to HF checkpoint folders; a GGUF file keeps its own tensor types",
                             file=str(p), field="quantize")
    # refuse before any weight is read: a model that cannot fit would otherwise end in the OOM killer;
    # 262k-context models would be refused on small machines if the check assumed their full context
    # a -c beyond the trained length is allowed (with a warning, `_cap_context`) and checked as asked
    ctx = max_context or min(estimate(p, exact, load_mtp=load_mtp)["context"], DEFAULT_MAX_CONTEXT)
    check_fits(p, exact=exact, context=ctx, load_mtp=load_mtp, options=opts)
    model, gf, info = load_gguf(p, exact=exact, load_mtp=load_mtp, progress=progress, options=opts)
    _cap_context(model.cfg, max_context)
    # usable from any thread, first use included: no lazy graph may be left for another thread
    evaluate_all(model)
    release_at_exit()
    tok = Tokenizer.from_gguf(gf.reader, gf.path)
    return Model(model, tok, info, gf.path, time.perf_counter() - t0)


def _cap_context(cfg, max_context: int | None) -> None:
    """The context a generation may use: `max_context` (-c) when given, else the model's capped by
    DEFAULT_MAX_CONTEXT; `cfg.context_source` says which, for the errors that cite it. A
    `max_context` beyond the trained length is allowed with one warning, as llama.cpp does (rope
    goes on; quality past the trained length is the model's business)."""
    if max_context and max_context > cfg.context_length:
        logging.getLogger("mtp_engine").warning(
            "mtp-engine: warning: a context of %d positions (-c / max_context) is beyond the model's trained "
            "length of %d: text past it may degrade", max_context, cfg.context_length)
        cfg.context_length = max_context
        cfg.context_source = "the max_context / -c setting (beyond the model's trained length)"
        return
    cap = max_context or DEFAULT_MAX_CONTEXT
    if cap < cfg.context_length:
        cfg.context_length = cap
        cfg.context_source = ("the max_context / -c cap" if max_context else
                              "the default cap (the model's is longer; raise it with max_context / -c)")


def _load_checkpoint(p: Path, quantize, load_mtp: bool, max_context: int | None, t0: float,
                     opts: EngineOptions, progress) -> Model:
    from .model.hf import check_checkpoint_fits, load_checkpoint

    check_checkpoint_fits(p, quantize, load_mtp, options=opts)
    tok_path = p / "tokenizer.json"
    if not tok_path.is_file():
        raise MTPEngineError("missing tokenizer.json: a checkpoint folder needs its tokenizer", file=str(tok_path))
    tok = Tokenizer.from_hf_file(str(tok_path))
    model, _, info = load_checkpoint(p, quantize=quantize, load_mtp=load_mtp, progress=progress, options=opts)
    _cap_context(model.cfg, max_context)
    evaluate_all(model)  # usable from any thread, as a GGUF load is
    release_at_exit()
    # device costs are cached per model file; a folder quantized on load is its own model
    path = str(p) if quantize is None else f"{p}?quantize={info.quantization}"
    return Model(model, tok, info, path, time.perf_counter() - t0)


def _persist_kernel_cache(cache_dir: Path) -> None:
    """MLX's CUDA backend keeps the kernels it compiles (NVRTC) in `$MLX_PTX_CACHE_DIR`, by default
    under the temp folder, which a reboot or a fresh container empties: the first run then spends
    most of its time compiling. Keep them in the engine's cache folder instead, unless the user
    chose a place. Must run before the first kernel is compiled (MLX reads the variable once)."""
    if mlx_kernel_cache_dir() is not None:
        return
    import mlx.core as mx

    from .model import kernels
    if kernels.cuda():
        keep_mlx_kernels_in(cache_dir / "mlx-ptx" / mx.__version__)


def _prepare_mlx_modules(path: Path) -> None:
    """MLX's own CUDA modules a first generation needs (a prompt's forward, plain steps, draft-mtp
    rounds; for a GGUF file also a long prompt's and a batch's, on the model's miniature), compiled
    in worker processes while the model loads (`mlx_jit`); off a CUDA GPU, or where earlier runs
    prepared them, nothing."""
    from .batching import warm
    from .model import blocks
    from .model.kernels import mlx_jit
    from .speculative import round as spec_round

    model = warm.recipes(str(path.resolve())) if path.is_file() else []
    mlx_jit.prepare([*mlx_jit.GENERIC, *blocks.JIT_RECIPES, *spec_round.JIT_RECIPES, *model])


def _resolve(model) -> Model:
    if isinstance(model, Model):
        return model
    if model is None or isinstance(model, (str, os.PathLike)):
        return load(model)
    raise MTPEngineError(f"expected a path or a loaded Model, found {type(model).__name__}", field="model")


def stream_generate(prompt: str | list[int] | None = None, model: Model | str | None = None,
                    **keywords) -> Iterator[Chunk]:
    """Streams text chunks; the last chunk carries `finish_reason` and `stats`.

    `prompt` is text (or token ids); `messages` renders the model's chat template instead.
    `spec` is None/"none" (plain decoding), "draft-mtp" (the model's MTP head drafts) or "ngram"
    (prompt lookup), with llama.cpp's knobs n_max, n_min, p_min;
    n_max="auto" (the default) picks the draft length each round from the time this run measures
    per round and the acceptance seen so far (docs/spec.md, "n-max auto").
    `profile` is None, "round" or "precise" (see `mtp_engine.generation.profiler`).
    Penalties as llama.cpp applies them, over the last `repeat_last_n` tokens (prompt included; 0
    disables, -1 = whole context): `repeat_penalty` divides positive logits (multiplies negative
    ones) of tokens seen, `frequency_penalty` subtracts per occurrence, `presence_penalty` once.
    draft-mtp stays lossless under them. `logprobs`: None, or report each token's log-probability
    plus that many alternatives (0..20) in `Chunk.logprobs`.

    The same options as objects: `spec=SpecConfig(method, n_max, n_min, p_min)` (n_max None =
    auto) and `sampler=SamplerConfig(temperature, top_k, top_p, min_p, seed, penalties, logprobs)`;
    a keyword moved off its default beside the object that also holds it is refused.

    `tools` (with `messages`): OpenAI-style function tools, rendered by the chat template;
    the last chunk's `tool_calls` (and `GenerationResult.tool_calls`) are the calls the model wrote
    (`mtp_engine.chat.tool_calls`). Assistant messages may carry earlier `tool_calls`. `tool_choice`
    as OpenAI's: "auto", "none" (tools not rendered), "required" or {"type": "function",
    "function": {"name": ...}} (a grammar makes the answer such a call).

    `constraint`: a `Constraint` (JSON schema, any JSON object, regex, Lark grammar) the text must
    follow: every scored row's logits are masked to what the grammar allows (drafts are verified
    against it, so draft-mtp gives what plain constrained decoding gives); needs llguidance.

    `prompt_cache`: a `PromptCache` given to successive calls: each reuses the state of the
    previous prompt where the new one starts with it (a chat's next turn prefills only what is
    new) and keeps its own; `stats["cached_prompt_tokens"]` says how many tokens were reused.

    Text (`prompt`, message `role`/`content`, `stop`) must be valid Unicode: a lone surrogate is
    refused (MTPEngineError naming the argument and the index), never replaced; a prompt longer
    than the context is refused after tokenizing about one context of it. The chat template renders
    under the budget of `mtp_engine.chat.template.RenderLimits`."""
    prepared, m = _prepared(prompt, model, "stream_generate", keywords)
    yield from stream_request(prepared, m)


def _prepared(prompt, model, caller: str, keywords: dict) -> tuple[Prepared, Model]:
    """The request of the API's keywords (`request.keywords.KEYWORDS`, checked before a model is
    loaded), prepared for the model; and the model."""
    req = request_from_keywords(prompt, caller=caller, **keywords)
    m = _resolve(model)
    prepared = prepare(m, req)
    note = chat_template_note(m) if req.messages is not None else None
    if note:  # the command line and the server say it once, at load
        warnings.warn(note, stacklevel=3)
    return prepared, m


def stream_request(request: GenerationRequest | Prepared, model: Model | str | None = None) -> Iterator[Chunk]:
    """`stream_generate` for a `GenerationRequest` (the typed request every front end builds), or
    for one already prepared (`request.prepare.prepare`) for this model. A plain request on a
    model with a batch scheduler (`load(..., parallel=N)`, `serve --parallel N`) decodes in its
    batches, beside the other threads' requests; any other runs alone."""
    m = _resolve(model)
    prepared = request if isinstance(request, Prepared) else prepare(m, request)
    if m.scheduler is not None and batchable(prepared.request, m.scheduler):
        chunks = stream_batched(m.scheduler, prepared, m)
    else:
        chunks = _decode_alone(prepared, m)
    yield from _finished(chunks, prepared, m)


@engine_thread
def _decode_alone(prepared: Prepared, m: Model) -> Iterator[Chunk]:
    req = prepared.request
    prof = Profiler(req.profile or "off")
    seed, agree = None, None
    if m.comm is not None:  # one random state and rank 0's draft lengths on every rank
        from .distributed import common_seed
        seed = common_seed(m.comm, req.sampler.seed)
        agree = m.comm.broadcast_int if m.comm.size > 1 else None
    decoder = make_decoder(m, prepared, prof, seed, agree)
    chunks = run(decoder, m.tokenizer, prepared.prompt_ids, prepared.max_tokens, stop=req.stop,
                 ignore_eos=req.ignore_eos, profiler=prof)
    if m.comm is not None:
        chunks = m.comm.guard(chunks)
    yield from chunks


def _finished(chunks: Iterator[Chunk], prepared: Prepared, m: Model) -> Iterator[Chunk]:
    """The chunks, the last one carrying the model's load time and the tool calls the text holds
    (when tools were given), alone or batched alike."""
    calls = tool_calls.ToolCallStream(prepared.tool_format, prepared.request.rendered_tools) \
        if prepared.tool_format is not None else None
    try:
        for chunk in chunks:
            if calls is not None:
                calls.feed(chunk.text)
            if chunk.finish_reason is not None:
                chunk.stats["load_seconds"] = m.load_seconds
                if calls is not None:
                    calls.finish()
                    chunk.tool_calls = calls.calls
            yield chunk
    finally:  # a stream closed early ends its generation now (a batch frees its slot)
        chunks.close()


DEFAULT_PARALLEL = 8


def batch_generate(prompts: list[str | list[int]], model: Model | str | None = None, *, max_tokens: int = 256,
                   parallel: int | None = None, **kwargs) -> list[GenerationResult]:
    """Generates for every prompt, up to `parallel` sequences (default: all of them, at most
    DEFAULT_PARALLEL) decoding together in one batched forward per step, a new one joining as
    another ends (mlx-lm's `batch_generate`, continuous). One `GenerationResult` per prompt, in
    order; each as `generate` would give it alone (greedy: the same tokens). `kwargs`: generate's
    sampling, spec, stop and constraint keywords (each prompt gets the same); `spec="draft-mtp"`
    drafts with the MTP head for every sequence in one call and verifies them in one forward."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise MTPEngineError("expected a non-empty list of prompts", field="prompts")
    m = _resolve(model)
    # every request checked and prepared before any decoding: a bad one fails the call at once
    prepared = []
    for i, p in enumerate(prompts):
        try:
            prepared.append(prepare(m, request_from_keywords(p, caller="batch_generate", max_tokens=max_tokens,
                                                             **kwargs)))
        except MTPEngineError as e:
            raise MTPEngineError(f"prompts[{i}]: {e}", field=e.field) from None
    n = parallel if parallel is not None else min(len(prompts), DEFAULT_PARALLEL)
    scheduler = batch_scheduler(m, n, draft_mtp=prepared[0].request.spec.method == "draft-mtp", own_thread=False)
    want_lp = prepared[0].request.sampler.logprobs is not None

    def one(p: Prepared) -> GenerationResult:
        return GenerationResult.collect(_finished(stream_batched(scheduler, p, m), p, m), p.prompt_ids, want_lp)

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="mtp-engine-batch-reader") as pool:
        futures = [pool.submit(one, p) for p in prepared]
        _drive(scheduler, lambda: all(f.done() for f in futures))
        for i, f in enumerate(futures):
            e = f.exception()
            if isinstance(e, MTPEngineError):
                raise MTPEngineError(f"prompts[{i}]: {e}", field=e.field) from e
        return [f.result() for f in futures]


@run_on_engine_thread
def _drive(scheduler: BatchScheduler, until) -> None:
    scheduler.drive(until)


def generate(prompt: str | list[int] | None = None, model: Model | str | None = None,
             **keywords) -> GenerationResult:
    """Generates up to `max_tokens` tokens; returns text, token ids and statistics.

    Example: `generate("def fib(n):", spec="draft-mtp", n_max=3)`, or with the options as objects
    `generate("def fib(n):", spec=SpecConfig(n_max=3), sampler=SamplerConfig(temperature=0.7))`."""
    prepared, m = _prepared(prompt, model, "generate", keywords)
    want_lp = prepared.request.sampler.logprobs is not None
    return GenerationResult.collect(stream_request(prepared, m), prepared.prompt_ids, want_lp)


_FIRST = [("prompt", None, "str | list[int] | None"), ("model", None, "Model | str | None")]
stream_generate.__signature__ = keyword_signature("Iterator[Chunk]", _FIRST)
generate.__signature__ = keyword_signature("GenerationResult", _FIRST)
