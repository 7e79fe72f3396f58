"""Images/s of kiln's image-folder input pipeline against torchvision's own, in one run:

- kiln: data=image_folder's training set through kiln's DataLoader (SeededItemSampler,
  decode_image with the Pillow fallback, a per-item seeded augmentation, ImageCollate);
- baseline: `torchvision.datasets.ImageFolder` (Pillow's loader) with the very same transform
  objects (PILToTensor first) in a plain shuffling DataLoader;

same folder of photos, workers, batch size and torch threads, interleaved round by round
(which pipeline goes first alternates; round 0 warms both up and is not counted). Reported: the
median ratio kiln / torchvision with its spread over the rounds, against a floor of 0.95. Speed
is reported, never asserted, unless --check (exit 1 below the floor).

    python scripts/bench_image_folder.py                       # 512 generated photos
    python scripts/bench_image_folder.py --format png          # the same photos as PNG files
    python scripts/bench_image_folder.py --folder my/train --workers 4 --augment trivialaugment
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_sample_images

from kiln.config import load_config
from kiln.data import build_data
from kiln.data.loaders import build_dataloaders

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamp, write_report  # noqa: E402

FLOOR = 0.95


def progress(message: str) -> None:
    print(f"[bench_image_folder] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="a folder of class subfolders (default: generated)")
    parser.add_argument("--images", type=int, default=512, help="generated photos (4 classes)")
    parser.add_argument(
        "--format", choices=["jpg", "png"], default="jpg", help="of the generated photos"
    )
    parser.add_argument("--image-size", type=int, default=224, help="data.image_size")
    parser.add_argument("--augment", default="flip_crop", help="data.augment")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers, both")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
    parser.add_argument("--workdir", help="where photos and caches go (default: a temp dir)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--check", action="store_true", help=f"exit 1 below the {FLOOR} floor")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table as docs/benchmarks.md holds it (date, commit, machine) at the end",
    )
    args = parser.parse_args(argv)
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: a run that proves it works
        args.images, args.image_size, args.rounds = min(args.images, 64), 32, 1
    if min(args.images - 7, args.rounds, args.batch_size, args.workers + 1) < 1:
        parser.error("--images >= 8, --rounds >= 1, --batch-size >= 1, --workers >= 0")
    return args


def make_photos(root: Path, count: int, seed: int = 0, fmt: str = "jpg") -> Path:
    """`count` photos (JPEG, or PNG: `fmt`) of 224-400 pixels a side in 4 classes, cropped from
    the sample photos scikit-learn and matplotlib ship (as examples/photos, at sizes a camera
    folder has)."""
    china, flower = load_sample_images().images
    hopper = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")
    sources = [Image.fromarray(china), Image.fromarray(flower), hopper.convert("RGB")]
    rng = np.random.default_rng(seed)
    for i in range(count):
        photo = sources[i % 4 % 3]
        side = int(rng.integers(300, min(photo.size)))
        x = int(rng.integers(0, photo.size[0] - side + 1))
        y = int(rng.integers(0, photo.size[1] - side + 1))
        out = (int(rng.integers(224, 401)), int(rng.integers(224, 401)))
        image = photo.crop((x, y, x + side, y + side)).resize(out, Image.Resampling.BILINEAR)
        folder = root / f"class_{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        options = {"quality": 90} if fmt == "jpg" else {}
        image.save(folder / f"{i:05d}.{fmt}", **options)
    return root


def kiln_loader(folder: Path, args, cache: Path):
    cfg = load_config(
        [
            "data=image_folder",
            f"data.train_dir={folder}",
            f"data.val_dir={folder}",  # every image trains; the val split is not timed
            f"data.cache_dir={cache}",
            f"data.image_size={args.image_size}",
            f"data.augment={args.augment}",
            f"data.batch_size={args.batch_size}",
            f"data.num_workers={args.workers}",
            "data.normalize=imagenet",
        ]
    )
    bundle = build_data(cfg.data)
    train, _ = build_dataloaders(bundle, cfg.data, seed=0, rank=0, world_size=1, cuda=False)
    return bundle, train


def torchvision_loader(folder: Path, bundle, args):
    """The same transform objects kiln's training set applies, after Pillow's loader."""
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    train = bundle.train
    transform = v2.Compose([v2.PILToTensor(), train.transform, train.finish])
    dataset = ImageFolder(str(folder), transform=transform)
    workers = args.workers
    return DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )


def images_per_s(loader, epoch: int) -> float:
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    start, count = time.perf_counter(), 0
    for images, _ in loader:
        count += len(images)
    return count / (time.perf_counter() - start)


def measure(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        folder = (
            Path(args.folder)
            if args.folder
            else make_photos(work / "photos", args.images, fmt=args.format)
        )
        progress(f"scanning {folder}")
        bundle, kiln = kiln_loader(folder, args, work / "cache")
        baseline = torchvision_loader(folder, bundle, args)
        pipelines = {"kiln": kiln, "torchvision": baseline}
        rates: dict[str, list[float]] = {name: [] for name in pipelines}
        for round_ in range(args.rounds + 1):  # round 0: warm-up (workers, caches)
            order = list(pipelines) if round_ % 2 == 0 else list(pipelines)[::-1]
            measured = {name: images_per_s(pipelines[name], round_) for name in order}
            if round_:
                for name, rate in measured.items():
                    rates[name].append(rate)
                progress(
                    f"round {round_}: kiln {measured['kiln']:.0f} images/s, torchvision "
                    f"{measured['torchvision']:.0f} images/s"
                )
    ratios = [k / t for k, t in zip(rates["kiln"], rates["torchvision"], strict=True)]
    median = statistics.median(ratios)
    return {
        "images": len(bundle.train),
        "format": "(--folder)" if args.folder else args.format,
        "image_size": args.image_size,
        "augment": args.augment,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "kiln_images_per_s": rates["kiln"],
        "torchvision_images_per_s": rates["torchvision"],
        "ratios": ratios,
        "median_ratio": median,
        "spread": [min(ratios), max(ratios)],
        "floor": FLOOR,
        "meets_floor": median >= FLOOR,
    }


def table(result: dict) -> str:
    kiln, base = result["kiln_images_per_s"], result["torchvision_images_per_s"]
    low, high = result["spread"]
    setting = (
        f"{result['images']} {result['format']} photos at {result['image_size']}px, "
        f"augment={result['augment']}, "
        f"batch {result['batch_size']}, {result['workers']} workers, {result['threads']} "
        f"thread(s), {result['rounds']} rounds"
    )
    rows = [
        setting,
        "",
        "| pipeline | images/s (median) | min | max |",
        "|---|---:|---:|---:|",
        _row("kiln image_folder", kiln),
        _row("torchvision ImageFolder", base),
        f"| ratio kiln / torchvision | {result['median_ratio']:.2f} | {low:.2f} | {high:.2f} |",
        "",
        f"floor {result['floor']}: {'met' if result['meets_floor'] else 'MISSED'}",
    ]
    return "\n".join(rows)


def _row(name: str, rates: list[float]) -> str:
    return f"| {name} | {statistics.median(rates):.0f} | {min(rates):.0f} | {max(rates):.0f} |"


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    result = measure(args)
    text = stamp(load) + "\n\n" + table(result)
    # result["markdown"]: what docs/benchmarks.md's figures block shows (kiln.cli.docs)
    write_report(result, text, Path(args.out) if args.out else None)
    print(table(result), flush=True)
    if args.markdown:
        print("\n" + text, flush=True)
    return 1 if args.check and not result["meets_floor"] else 0


if __name__ == "__main__":
    sys.exit(main())
