"""Memory planner: KV bytes per tier and the PCIe cost of streaming T1, from a model's shapes alone.

Pure arithmetic on the config (no weights): answers offline for the built-in shapes and their hub ids,
``random:<preset>`` names, or a path to a ``config.json`` (or a directory holding one).

Hybrid models (gpt-oss, Gemma 3) keep only their window in a sliding layer: those K/V stay on the device whatever
the ratios say, and the tiers split the full-attention layers' K/V. Mixture-of-experts weights count whole in
memory; a decode step reads the experts its batch's tokens route to (expected distinct experts, uniform routing).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import TierConfig, budget
from ..models import HUB_SHAPES, PRESETS, ModelLoadError, preset_config
from ..tiers.quant import int8_bytes_per_token

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
    sliding_layers: int = 0  # of ``layers``: sliding-window layers, which keep only their last ``window`` tokens
    window: int = 0
    experts: int = 0  # mixture of experts: experts per layer (0: one dense MLP) and how many a token uses
    experts_per_token: int = 0

    @property
    def full_layers(self) -> int:
        """Layers that attend every token: the ones whose K/V the tiers hold."""
        return self.layers - self.sliding_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over the full-attention layers (every layer, in a model without sliding ones)."""
        return self.full_layers * self.kv_heads * self.head_dim * 2 * dtype_bytes

    def sliding_bytes_per_seq(self, seq_len: int, dtype_bytes: int = 2) -> int:
        """K and V the sliding layers hold for one sequence: its last ``window`` tokens each, on the device."""
        return self.sliding_layers * min(seq_len, self.window) * self.kv_heads * self.head_dim * 2 * dtype_bytes

    def int8_bytes_per_token(self) -> int:
        """T2: int8 values plus one float32 scale per (token, kv-head), K and V, full-attention layers."""
        return int8_bytes_per_token(self.full_layers, self.kv_heads, self.head_dim)

    def _expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def n_params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = self._expert_params() * max(1, self.experts) + self.hidden * self.experts  # + the router
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + emb + self.hidden

    def params_read_per_step(self, batch: int) -> int:
        """Weights one decode step of ``batch`` rows reads: all of a dense model; of a mixture of experts, the
        experts its rows route to — ``E * (1 - (1 - k/E)^batch)`` per layer in expectation (uniform routing)."""
        if not self.experts:
            return self.n_params()
        e, k = self.experts, self.experts_per_token
        touched = e * (1 - (1 - k / e) ** batch)
        return int(self.n_params() - self.layers * (e - touched) * self._expert_params())


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
                     c.intermediate_size, c.vocab_size, c.num_attention_heads, bool(c.tie_word_embeddings),
                     **_hybrid(c.to_dict()))
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
                         bool(c.get("tie_word_embeddings", False)), **_hybrid(c))
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"{path}: a shape field is not a positive integer ({e})") from None
    known = ", ".join(sorted(HUB_SHAPES))
    raise ModelLoadError(f"no built-in shapes for {model!r}; pass a path to its config.json (built in: {known}, random:<preset>)")


def _hybrid(c: dict) -> dict:
    """Sliding layers (from ``layer_types``) and experts of a config dict, as :class:`Shape` fields."""
    types = c.get("layer_types") or []
    sliding = sum(t == "sliding_attention" for t in types)
    out = {"sliding_layers": sliding, "window": int(c.get("sliding_window") or 0) if sliding else 0}
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    if experts:
        out.update(experts=experts, experts_per_token=int(c.get("num_experts_per_tok") or c.get("experts_per_token")))
    return out


@dataclass(frozen=True)
class Hardware:
    """Bandwidths of one machine, GB/s: device memory, host->device (pinned, effective), and what host attention
    reaches over T1 in host DRAM. ``source`` says where each number comes from."""

    name: str
    hbm_gbps: float
    pcie_gbps: float
    host_gbps: float
    source: str


# Datasheet numbers where a datasheet gives them; effective PCIe is ~85% of the link rate (what pinned memcpy reaches
# in practice); host attention is an assumption (a few worker threads on a memory-bound kernel reach about half of
# one socket's DRAM peak): measure yours with `kvtier bench` and pass --host-gbps.
HARDWARE: dict[str, Hardware] = {
    "h200": Hardware("h200", 4800.0, 55.0, 150.0, "HBM3e 4.8 TB/s (NVIDIA H200 SXM datasheet); PCIe 5.0 x16 64 GB/s link "
                     "(PCI-SIG), ~55 effective; host: half of one DDR5-4800 8-channel socket (307 GB/s), assumed"),
    "h100": Hardware("h100", 3350.0, 55.0, 150.0, "HBM3 3.35 TB/s (NVIDIA H100 SXM datasheet); PCIe 5.0 x16 ~55 "
                     "effective; host as h200, assumed"),
    "a100": Hardware("a100", 2039.0, 26.0, 100.0, "HBM2e 2.04 TB/s (NVIDIA A100 80GB SXM datasheet); PCIe 4.0 x16 "
                     "32 GB/s link, ~26 effective; host: half of one DDR4-3200 8-channel socket (205 GB/s), assumed"),
    "l40s": Hardware("l40s", 864.0, 26.0, 100.0, "GDDR6 864 GB/s (NVIDIA L40S datasheet); PCIe 4.0 x16 ~26 effective; "
                     "host as a100, assumed"),
    "rtx5080": Hardware("rtx5080", 960.0, 55.0, 40.0, "GDDR7 960 GB/s (GeForce RTX 5080 specifications: 30 Gbps x "
                        "256-bit); PCIe 5.0 x16 ~55 effective; host: dual-channel DDR5-6000 (96 GB/s peak), ~40 reached, assumed"),
    "cpu": Hardware("cpu", 40.0, 20.0, 40.0, "a CPU-only machine: the device is the host (DRAM ~40 GB/s for a few cores, "
                    "assumed); 'stream' is a memcpy (reads and writes: half the bandwidth)"),
}


def _check_gbps(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
        raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v!r}")


def step_floors(weights: int, t0: int, t1: int, t2_int8: int, t2_fp: int, full: int, hw: Hardware) -> dict[str, float]:
    """Decode-step floors in seconds, from bytes per step and bandwidths (every byte read once per step).

    full:   the full cache on the device: (weights + all KV) / HBM.
    stream: T1 and int8 T2 cross PCIe while the device reads weights, T0 and the staged T1/T2 (T2 dequantised):
            max(PCIe time, HBM time) — copies overlap compute.
    host:   the host attends T1 and T2 where they live while the device reads weights and T0:
            max(host time, HBM time).
    both:   T1/T2 split between the two so that both finish together: a share pcie / (pcie + host) streams.
    """
    g = 1e9
    host_bytes = t1 + t2_int8
    stream = max(host_bytes / (hw.pcie_gbps * g), (weights + t0 + t1 + t2_fp) / (hw.hbm_gbps * g))
    host = max(host_bytes / (hw.host_gbps * g), (weights + t0) / (hw.hbm_gbps * g))
    x = hw.pcie_gbps / (hw.pcie_gbps + hw.host_gbps)
    both = max(host_bytes / ((hw.pcie_gbps + hw.host_gbps) * g), (weights + t0 + x * (t1 + t2_fp)) / (hw.hbm_gbps * g))
    return {"full": (weights + full) / (hw.hbm_gbps * g), "stream": stream, "host": host, "both": both}


def plan(model: str, batch: int, seq_len: int, hbm_ratio: float = 0.3, evict_ratio: float = 0.03,
         quant_ratio: float = 0.0, dtype: str = "bf16", pcie_gbps: float | None = None, hbm_gbps: float | None = None,
         protected_tokens: int = 0, hardware: str = "h200", host_gbps: float | None = None) -> dict:
    """Bytes per tier for ``batch`` sequences of ``seq_len`` tokens and the decode-step floors per T1 mode.

    ``protected_tokens`` (prompt + sinks + recent window) stay in T0 whatever ``hbm_ratio`` says.
    ``hardware`` picks a bandwidth profile (:data:`HARDWARE`); explicit ``pcie_gbps`` / ``hbm_gbps`` / ``host_gbps``
    override it. Also answers: the smallest ``hbm_ratio`` whose best-mode floor stays within 5% of the full cache's.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if hardware not in HARDWARE:
        raise ValueError(f"--hardware must be one of {sorted(HARDWARE)}, got {hardware!r}")
    for name, v in (("batch", batch), ("seq_len", seq_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    base = HARDWARE[hardware]
    for name, v in (("pcie_gbps", pcie_gbps), ("hbm_gbps", hbm_gbps), ("host_gbps", host_gbps)):
        if v is not None:
            _check_gbps(name, v)
    hw = Hardware(base.name if (pcie_gbps, hbm_gbps, host_gbps) == (None, None, None) else f"{base.name} (overridden)",
                  hbm_gbps or base.hbm_gbps, pcie_gbps or base.pcie_gbps, host_gbps or base.host_gbps, base.source)
    if isinstance(protected_tokens, bool) or not isinstance(protected_tokens, int) or protected_tokens < 0:
        raise ValueError(f"--protected-tokens must be an integer >= 0, got {protected_tokens!r}")
    TierConfig(hbm_ratio=hbm_ratio, quant_ratio=quant_ratio, evict_ratio=evict_ratio)  # validates the ratios
    s = shape_of(model)
    eb = DTYPE_BYTES[dtype]
    fp, q8 = s.kv_bytes_per_token(eb), s.int8_bytes_per_token()
    weights = s.params_read_per_step(batch) * eb  # what a step reads (a mixture of experts: its routed experts)
    sliding = s.sliding_bytes_per_seq(seq_len, eb) * batch  # on the device, read every step, never tiered
    full = seq_len * fp * batch

    def tokens(h: float) -> tuple[int, int, int, int]:
        n3 = budget(evict_ratio, seq_len)
        n2 = budget(quant_ratio, seq_len)
        n0 = min(max(protected_tokens, budget(h, seq_len)), seq_len - n3 - n2)
        return n0, seq_len - n0 - n2 - n3, n2, n3

    def floors(h: float) -> dict[str, float]:
        n0, n1, n2, _ = tokens(h)
        return step_floors(weights, n0 * fp * batch + sliding, n1 * fp * batch, n2 * q8 * batch, n2 * fp * batch,
                           full + sliding, hw)

    n0, n1, n2, n3 = tokens(hbm_ratio)
    per_seq = {"T0": n0 * fp, "T1": n1 * fp, "T2": n2 * q8, "T3": 0}
    per_batch = {k: v * batch for k, v in per_seq.items()}
    f = floors(hbm_ratio)
    modes = ("stream", "host", "both")
    best = min(modes, key=lambda m: f[m])
    smallest = {}
    for m in modes + ("best",):
        smallest[m] = next((round(i / 100, 2) for i in range(101)
                            if (min(floors(i / 100)[x] for x in modes) if m == "best" else floors(i / 100)[m])
                            <= 1.05 * f["full"]), None)
    pcie_step = per_batch["T1"] + per_batch["T2"]
    t_pcie = pcie_step / (hw.pcie_gbps * 1e9)
    t_hbm = (weights + per_batch["T0"] + sliding + n1 * fp * batch + n2 * fp * batch) / (hw.hbm_gbps * 1e9)
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
        "layers": {"full": s.full_layers, "sliding": s.sliding_layers, "window": s.window},
        "sliding_kv_bytes_per_batch": sliding,
        "sliding_share_of_kv": sliding / (sliding + full) if sliding + full else 0.0,
        "full_kv_bytes_per_batch": full + sliding,
        "device_kv_bytes": per_batch["T0"] + sliding,
        "device_bytes_saved": full - per_batch["T0"],
        "host_bytes": per_batch["T1"] + per_batch["T2"],
        "weights_bytes": s.n_params() * eb,
        "weights_read_per_step_bytes": weights,
        "pcie_bytes_per_step": pcie_step,
        "hardware": asdict(hw),
        "step_floor_ms": {"pcie": 1e3 * t_pcie, "hbm": 1e3 * t_hbm, "overlapped": 1e3 * max(t_pcie, t_hbm),
                          "serial": 1e3 * (t_pcie + t_hbm), "full_cache": 1e3 * f["full"],
                          "stream": 1e3 * f["stream"], "host": 1e3 * f["host"], "both": 1e3 * f["both"]},
        "best_mode": best,
        "throughput_ratio_floor": f["full"] / f[best],
        "throughput_ratio_floor_by_mode": {m: f["full"] / f[m] for m in modes},
        "smallest_hbm_ratio_within_5pct": smallest,
        "pcie_gbps": hw.pcie_gbps,
        "hbm_gbps": hw.hbm_gbps,
        "host_gbps": hw.host_gbps,
    }
