"""The fused CPU kernel at a git revision vs the working tree's, side by side in one process (A/B of a kernel change).

    python benchmarks/kernels/kernel_ab.py --base HEAD [--reps 150] [--threads 0]

Both sources are built as kvtier builds its kernel (``kvtier.kernels.build.build``, with the headers of its ``csrc/``) into a temporary directory, then
timed interleaved (each repetition runs SDPA, then base and working tree in alternating order) over one layer of Qwen2.5-0.5B's shapes
(2 kv-heads x 7 query heads, head dim 64), two regions (30% / 70% of the context, as ``tiered`` hbm 0.3 lays
them out), with the score update. Prints per-call medians, each vs SDPA over the same keys, new/base, and the
largest difference between the two outputs (0 when a change keeps the same floats). ``--base HEAD`` with no
change is the control: its new/base is the noise.

``--staged``: the second region is streamed (``t1_attention="stream"``: the kernel copies it through its staging
buffer). ``--layers N``: each repetition goes through N layers' inputs in turn (as a model step does), so that a
layer's K/V come from memory rather than from the cache the previous call left them in (24 layers of the 0.5B
model at 4096 tokens are ~150 MB).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_micro import layer_inputs  # this folder is on sys.path when run as a script

from kvtier.kernels import build as kbuild

SHAPES = [(1, 2048, torch.float32), (1, 2048, torch.bfloat16), (4, 8192, torch.float32), (4, 8192, torch.bfloat16)]


def build(tag: str, src: Path, root: Path):
    out = root / tag
    out.mkdir(parents=True, exist_ok=True)
    return kbuild.build(f"kvtier_kernel_ab_{tag}", src, out)


# where the decode kernel's source lived at a revision: kvtier/kernels/csrc/ since the kernels got one home
OLD_SOURCES = ("kvtier/kernels/csrc/fused_decode_cpu.cpp", "kvtier/attention/csrc/fused_decode_cpu.cpp")


def base_source(rev: str, root: Path, src: Path = kbuild.DECODE_SRC) -> Path:
    """The kernel source at git revision ``rev`` and the headers beside it then, written to ``root/base_src/``."""
    out = root / "base_src"
    out.mkdir(parents=True, exist_ok=True)
    for rel in [p.replace("fused_decode_cpu.cpp", src.name) for p in OLD_SOURCES]:
        got = subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True)
        if got.returncode == 0:
            break
    else:
        raise SystemExit(f"{src.name} is not at {rev} under {' or '.join(OLD_SOURCES)}")
    (out / src.name).write_bytes(got.stdout)
    folder = rel.rsplit("/", 1)[0]
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{folder}"], capture_output=True, text=True)
    for name in names.stdout.split():
        if name.endswith(".h"):
            (out / name).write_bytes(subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], check=True,
                                                    capture_output=True).stdout)
    return out / src.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base kernel source")
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--staged", action="store_true", help="stream the second region through the staging buffer")
    ap.add_argument("--layers", type=int, default=1, help="distinct layers' inputs visited in turn per repetition")
    ap.add_argument("--shapes", default=None, help="BxT,... (e.g. 1x4096,4x2048); default: the built-in list")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_src = base_source(args.base, root)
        mods = {"base": build("base", base_src, root), "new": build("new", kbuild.DECODE_SRC, root)}
        print(f"base {args.base} vs working tree, flags {' '.join(kbuild.flags())}, "
              f"threads {torch.get_num_threads()}")
        shapes = SHAPES if not args.shapes else [(int(b), int(t), dt) for b, t in
                                                  (x.split("x") for x in args.shapes.split(","))
                                                  for dt in (torch.float32, torch.bfloat16)]
        staged = [False, True] if args.staged else []
        print(f"second region staged: {args.staged}; {args.layers} layer(s) visited in turn")
        for B, T, dt in shapes:
            H, g, D = 2, 7, 64
            layers = []
            for _ in range(args.layers):  # distinct memory, the same numbers (layer_inputs is seeded)
                q, k, v, (ks, vs, biases, poss), acc = layer_inputs(B, H, g, D, T, dt)
                layers.append((q, k, v, ks, vs, biases, poss, acc))
            times: dict[str, list[float]] = {"sdpa": [], "base": [], "new": []}
            outs = {}
            pairs = list(mods.items())
            for rep in range(args.reps):
                # SDPA per layer call, each kernel over all the layers: per-call times (the kernels' layers are
                # visited in turn, so each call finds its layer's K/V where a model step would: in memory)
                for q, k, v, *_ in layers[:1]:
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)
                    times["sdpa"].append(time.perf_counter() - t0)
                # the second of two kernels over the same inputs finds them in cache (measured: identical sources
                # read 0.85x at 1 x 2048): the order alternates, so neither side gets that every time
                for name, mod in (pairs if rep % 2 == 0 else pairs[::-1]):
                    t0 = time.perf_counter()
                    for q, _, _, ks, vs, biases, poss, acc in layers:
                        outs[name] = mod.fused_decode(q, ks, vs, biases, poss, [acc, acc], 1e-3, D ** -0.5, staged)
                    times[name].append((time.perf_counter() - t0) / len(layers))
            md = {n: statistics.median(x) * 1e3 for n, x in times.items()}
            diff = (outs["base"].float() - outs["new"].float()).abs().max().item()
            print(f"B={B} T={T} {str(dt).removeprefix('torch.'):9s} sdpa {md['sdpa']:.3f} ms  "
                  f"base {md['base']:.3f} ({md['base'] / md['sdpa']:.2f}x)  new {md['new']:.3f} "
                  f"({md['new'] / md['sdpa']:.2f}x)  new/base {md['new'] / md['base']:.2f}  max|diff| {diff:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
