"""What ``phalanx.digest.digest`` (``phalanx.rank.digest``) costs per GB of parameters.
Prints JSON.

    python bench/digest.py [--gb 1.0] [--repeats 5] [--dtype float32]

The parameters are a transformer-like set of tensors (a few large matrices and many
small vectors) of ``--gb`` GB in all, on the CPU (and on the GPU too when CUDA is
there). The baseline, measured in the same run, is one float ``sum`` over the same
bytes in a single flat tensor: the memory-bound floor the digest is compared with.
``int32_widened`` is the first design (each float32 viewed as int32, summed widened to
int64), which torch does ~8x slower than a native int64 sum. Each figure is the median
of ``--repeats`` runs, in seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from phalanx.digest import digest


def params(gb: float, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    width = torch.empty((), dtype=dtype).element_size()
    total = int(gb * 1e9) // width
    big = total // 8
    side = int(big**0.5)
    out = [torch.randn(side, side, device=device).to(dtype) for _ in range(8)]
    out += [torch.randn(4096, device=device).to(dtype) for _ in range(64)]  # norms, biases
    return out


def timed(fn: Any, repeats: int, sync: Any) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case(gb: float, dtype: torch.dtype, device: str, repeats: int) -> dict[str, Any]:
    tensors = params(gb, dtype, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    digest(tensors)  # warm up
    took = timed(lambda: digest(tensors), repeats, sync)
    floor = timed(lambda: flat.sum().item(), repeats, sync)
    widened = timed(lambda: flat.view(ints).sum(dtype=torch.int64).item(), repeats, sync)
    gbs = nbytes / 1e9
    return {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "gb": round(gbs, 3),
        "tensors": len(tensors),
        "digest_s_per_gb": round(took / gbs, 4),
        "flat_float_sum_s_per_gb": round(floor / gbs, 4),
        "ratio_to_flat_float_sum": round(took / floor, 2),
        "int32_widened_s_per_gb": round(widened / gbs, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    results = [case(args.gb, dtype, "cpu", args.repeats)]
    if torch.cuda.is_available():
        results.append(case(args.gb, dtype, "cuda", args.repeats))
    print(json.dumps({"bench": "digest", "threads": torch.get_num_threads(), "cases": results}))


if __name__ == "__main__":
    main()
