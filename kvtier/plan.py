"""Memory planner: KV bytes per tier and the PCIe cost of streaming T1, from a model's shapes alone.

Pure arithmetic on the config (no weights): answers offline for the built-in shapes and their hub ids,
``random:<preset>`` names, or a path to a ``config.json`` (or a directory holding one).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import TierConfig, budget
from .models import HUB_SHAPES, PRESETS, ModelLoadError, preset_config
from .quant import int8_bytes_per_token

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    tied: bool

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over all layers."""
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes

    def int8_bytes_per_token(self) -> int:
        """T2: int8 values plus one float32 scale per (token, kv-head), K and V, all layers."""
        return int8_bytes_per_token(self.layers, self.kv_heads, self.head_dim)

    def n_params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + emb + self.hidden


def shape_of(model: str) -> Shape:
    """Shapes from a built-in name, a ``random:`` preset, a hub id with built-in shapes, or a config.json path."""
    preset = None
    if model.startswith("random:"):
        preset = model.removeprefix("random:")
    elif model in HUB_SHAPES:
        preset = HUB_SHAPES[model]
    elif model in PRESETS:
        preset = model
    if preset is not None:
        c = preset_config(preset)
        return Shape(model, c.num_hidden_layers, c.num_key_value_heads,
                     getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, c.hidden_size,
                     c.intermediate_size, c.vocab_size, c.num_attention_heads, bool(c.tie_word_embeddings))
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            c = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a JSON model config ({e})") from None
        if not isinstance(c, dict):
            raise ValueError(f"{path} is not a JSON model config (an object with num_hidden_layers, ...)")
        c = c.get("text_config", c)
        missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if k not in c]
        if missing:
            raise ValueError(f"{path} lacks {missing}: the planner needs num_hidden_layers, num_attention_heads, hidden_size")
        try:
            heads = int(c["num_attention_heads"])
            return Shape(str(model), int(c["num_hidden_layers"]), int(c.get("num_key_value_heads", heads)),
                         int(c.get("head_dim") or c["hidden_size"] // heads), int(c["hidden_size"]),
                         int(c.get("intermediate_size", 4 * c["hidden_size"])), int(c.get("vocab_size", 0)), heads,
                         bool(c.get("tie_word_embeddings", False)))
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"{path}: a shape field is not a positive integer ({e})") from None
    known = ", ".join(sorted(HUB_SHAPES))
    raise ModelLoadError(f"no built-in shapes for {model!r}; pass a path to its config.json (built in: {known}, random:<preset>)")


def plan(model: str, batch: int, seq_len: int, hbm_ratio: float = 0.3, evict_ratio: float = 0.03,
         quant_ratio: float = 0.0, dtype: str = "bf16", pcie_gbps: float = 50.0, hbm_gbps: float = 4800.0,
         protected_tokens: int = 0) -> dict:
    """Bytes per tier for ``batch`` sequences of ``seq_len`` tokens and the decode-step floors.

    ``protected_tokens`` (prompt + sinks + recent window) stay in T0 whatever ``hbm_ratio`` says.
    Step floors: the device must read every kept token's K/V once per step (plus the weights), and T1/T2
    must cross PCIe once per step; with the transfer engine overlapping both, the floor is the larger.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    for name, v in (("batch", batch), ("seq_len", seq_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    for name, v in (("pcie_gbps", pcie_gbps), ("hbm_gbps", hbm_gbps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v!r}")
    if isinstance(protected_tokens, bool) or not isinstance(protected_tokens, int) or protected_tokens < 0:
        raise ValueError(f"--protected-tokens must be an integer >= 0, got {protected_tokens!r}")
    TierConfig(hbm_ratio=hbm_ratio, quant_ratio=quant_ratio, evict_ratio=evict_ratio)  # validates the ratios
    s = shape_of(model)
    eb = DTYPE_BYTES[dtype]
    fp, q8 = s.kv_bytes_per_token(eb), s.int8_bytes_per_token()
    n3 = budget(evict_ratio, seq_len)
    n2 = budget(quant_ratio, seq_len)
    n0 = min(max(protected_tokens, budget(hbm_ratio, seq_len)), seq_len - n3 - n2)
    n1 = seq_len - n0 - n2 - n3
    per_seq = {"T0": n0 * fp, "T1": n1 * fp, "T2": n2 * q8, "T3": 0}
    per_batch = {k: v * batch for k, v in per_seq.items()}
    full = seq_len * fp * batch
    weights = s.n_params() * eb
    pcie_step = per_batch["T1"] + per_batch["T2"]
    hbm_step = weights + per_batch["T0"] + n1 * fp * batch + n2 * fp * batch  # T1/T2 are read again once staged
    t_pcie = pcie_step / (pcie_gbps * 1e9)
    t_hbm = hbm_step / (hbm_gbps * 1e9)
    t_full = (weights + full) / (hbm_gbps * 1e9)
    return {
        "model": model,
        "shape": asdict(s),
        "dtype": dtype,
        "batch": batch,
        "seq_len": seq_len,
        "ratios": {"hbm": hbm_ratio, "quant": quant_ratio, "evict": evict_ratio},
        "tokens_per_seq": {"T0": n0, "T1": n1, "T2": n2, "T3": n3},
        "kv_bytes_per_token": fp,
        "int8_bytes_per_token": q8,
        "bytes_per_seq": per_seq,
        "bytes_per_batch": per_batch,
        "full_kv_bytes_per_batch": full,
        "device_kv_bytes": per_batch["T0"],
        "device_bytes_saved": full - per_batch["T0"],
        "host_bytes": per_batch["T1"] + per_batch["T2"],
        "weights_bytes": weights,
        "pcie_bytes_per_step": pcie_step,
        "step_floor_ms": {"pcie": 1e3 * t_pcie, "hbm": 1e3 * t_hbm, "overlapped": 1e3 * max(t_pcie, t_hbm),
                          "serial": 1e3 * (t_pcie + t_hbm), "full_cache": 1e3 * t_full},
        "throughput_ratio_floor": t_full / max(t_pcie, t_hbm),
        "pcie_gbps": pcie_gbps,
        "hbm_gbps": hbm_gbps,
    }
