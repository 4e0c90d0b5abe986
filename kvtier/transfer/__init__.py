"""Data movement: the transfer engine (copies, staging, counters) and the asynchrony seam it reaches the device through."""

from .engine import TransferCounters, TransferEngine, memcpy_peak_gbps
from .seam import SYNC_POINTS, CpuSeam, CudaSeam, Seam, seam_for, use_seam

__all__ = ["SYNC_POINTS", "CpuSeam", "CudaSeam", "Seam", "TransferCounters", "TransferEngine", "memcpy_peak_gbps",
           "seam_for", "use_seam"]
