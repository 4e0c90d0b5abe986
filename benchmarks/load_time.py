"""First vs second load of the embedded model (GGUF dequantized once, then cached safetensors).

    python benchmarks/load_time.py            # uses a fresh temporary KVTIER_CACHE
"""

import os
import tempfile
import time

os.environ.setdefault("KVTIER_CACHE", tempfile.mkdtemp(prefix="kvtier-cache-"))

import kvtier  # noqa: E402
from kvtier.models import EMBEDDED_NAME  # noqa: E402

times = []
for _ in range(2):
    t = time.perf_counter()
    kvtier.load_model(EMBEDDED_NAME, device="cpu", dtype="bf16")
    times.append(time.perf_counter() - t)
print(f"cache dir: {os.environ['KVTIER_CACHE']}")
print(f"first load (concatenate + sha256 + dequantize GGUF + save safetensors): {times[0]:.1f} s")
print(f"second load (cached safetensors): {times[1]:.1f} s  -> {times[0] / times[1]:.0f}x faster")
