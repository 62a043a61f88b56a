"""Throughput of DenseNet-121 (TorchXRayVision, random weights) feature extraction.

Writes synthetic NIH-sized PNGs (1024 x 1024, 8-bit grayscale) to a temporary directory and measures,
separately:

1. PNG decoding alone, one process, and SHA-256 of the files' bytes (the cache key, one thread);
2. decoding + TorchXRayVision preprocessing (scale, center crop, skimage resize to 224), one process;
3. the same through the DataLoader with ``--num-workers`` workers (what feeds the network);
4. the network alone on preprocessed tensors already in memory (``features2``, batch ``--batch-size``);
5. end to end: :func:`secure_afl.features.extraction.extract_features` into an empty cache, then a rerun
   from the cache (which hashes every file again: the cache is keyed by content).

Run from the repository root (with the package installed, or ``PYTHONPATH=.``):
``python bench/bench_extraction.py [--n-images 256] [--device auto] [--num-workers N]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from secure_afl.features.backbones import load_backbone
from secure_afl.features.extraction import default_num_workers, extract_features, resolve_device
from secure_afl.features.images import ImageDataset, collate_images, hash_image_files, load_grayscale


def write_synthetic_pngs(directory: Path, n_images: int, size: int) -> list[Path]:
    """Smooth anatomy-like gradients plus noise, so PNG compression is close to real radiographs."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    base = 255 * (0.5 + 0.3 * np.sin(6 * xx) * np.cos(4 * yy))
    paths = []
    for i in range(n_images):
        pixels = np.clip(base + rng.normal(0, 6, (size, size)), 0, 255).astype(np.uint8)
        path = directory / f"{i // 10 + 1:08d}_{i % 10:03d}.png"
        Image.fromarray(pixels, mode="L").save(path)
        paths.append(path)
    return paths


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-images", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=default_num_workers())
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()

    device = resolve_device(args.device)
    torch.manual_seed(0)
    backbone = load_backbone("densenet121-xrv", None, random_init=True)
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench_extraction_") as workdir:
        paths = write_synthetic_pngs(Path(workdir) / "images", args.n_images, args.image_size)
        mean_kb = np.mean([p.stat().st_size for p in paths]) / 1024
        n = len(paths)

        rows.append(("PNG decode, 1 process", n / timed(lambda: [load_grayscale(p) for p in paths])))
        rows.append(("SHA-256 of the files, 1 thread", n / timed(lambda: hash_image_files(paths, workers=1))))
        tensors: list[torch.Tensor] = []
        rows.append(
            (
                "decode + xrv preprocess, 1 process",
                n / timed(lambda: tensors.extend(backbone.transform(load_grayscale(p)) for p in paths)),
            )
        )
        dataset = ImageDataset(paths, backbone.transform)
        loader = DataLoader(
            dataset, batch_size=args.batch_size, num_workers=args.num_workers, collate_fn=collate_images
        )
        rows.append((f"DataLoader, {args.num_workers} workers", n / timed(lambda: [b for b in loader])))

        backbone.module.to(device)
        batches = [torch.stack(tensors[i : i + args.batch_size]) for i in range(0, n, args.batch_size)]

        def forward_all() -> None:
            with torch.inference_mode():
                for batch in batches:
                    backbone.embed(batch.to(device)).cpu()

        with torch.inference_mode():
            backbone.embed(batches[0][:2].to(device))  # warm-up (allocator, kernel selection)
        rows.append((f"model forward only, batch {args.batch_size} on {device}", n / timed(forward_all)))
        result_box: list[object] = []
        end_to_end = timed(
            lambda: result_box.append(
                extract_features(
                    paths,
                    backbone,
                    cache_dir=Path(workdir) / "cache",
                    device=str(device),
                    batch_size=args.batch_size,
                    num_workers=args.num_workers,
                    progress=False,
                )
            )
        )
        rows.append(("end to end extract_features (empty cache)", n / end_to_end))
        cached = timed(
            lambda: extract_features(
                paths, backbone, cache_dir=Path(workdir) / "cache", device=str(device), progress=False
            )
        )
        rows.append(("rerun from the cache", n / cached))

    print(
        f"DenseNet-121 (xrv, random weights), {n} synthetic {args.image_size}x{args.image_size} PNGs "
        f"(mean {mean_kb:.0f} KiB), device {device}, torch threads {torch.get_num_threads()}, "
        f"{args.num_workers} loader workers"
    )
    print(f"{'stage':<48} {'images/s':>10} {'ms/image':>10}")
    for stage, rate in rows:
        print(f"{stage:<48} {rate:>10.1f} {1000 / rate:>10.2f}")
    if args.json is not None:
        report = {
            "images": n,
            "image_size": args.image_size,
            "mean_file_kib": float(mean_kb),
            "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "loader_workers": args.num_workers,
            "images_per_second": dict(rows),
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
