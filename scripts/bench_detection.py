"""Training images/s of kiln's engine on a torchvision detector against the loop torchvision's
reference writes (references/detection/engine.py, `train_one_epoch`), in one process:

- kiln: `Trainer.train_step` on model=torchvision_detection (the detection contract: the loss
  dict summed by the engine, the non-finite flag on the device, gradient-norm bookkeeping) plus
  its `after_step`;
- reference: the same network (torchvision's module itself, the same initial weights), the
  same optimizer and schedule built from the same config, stepped as `train_one_epoch` steps:

      loss_dict = model(images, targets); losses = sum(loss_dict.values())
      loss_value = losses.item()  # and stop if it is not finite
      optimizer.zero_grad(); losses.backward(); optimizer.step(); lr_scheduler.step()
      metric_logger.update(loss=losses, **loss_dict)  # each term read to the host

same data (the COCO folder made from real photos, kiln's data=coco reader), the same batches in
the same order (prefetched once, so both sides time training alone), one torch thread. Step 1 of
both runs from the same weights under the same seed (Faster R-CNN samples its proposals at
random): its losses must agree term by term. Then interleaved rounds of --steps steps a side
(which side goes first alternates; round 0 warms up and is not counted): the median of the
per-round ratios kiln / reference against a floor of 1.0. After each round, outside the timing,
both networks are evaluated on the validation photos (mAP and mAP@.5: torchmetrics'
MeanAveragePrecision, the computation of kiln's val_map): the two must learn alike. Speed is
reported, never asserted, unless --check.

    python scripts/bench_detection.py                     # fasterrcnn_mobilenet_v3_large_320_fpn
    python scripts/bench_detection.py --image-size 96 --rounds 3 --steps 4 --markdown
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.data import build_data
from kiln.data.photo_boxes import make_photo_boxes
from kiln.engine.distributed import DistInfo
from kiln.engine.optim import build_optimizer, build_scheduler
from kiln.engine.run import build_run
from kiln.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamp, write_report  # noqa: E402

FLOOR = 1.0  # kiln images/s over the reference loop's
LOSS_TOLERANCE = 1e-5  # step 1, each loss term, relative


def progress(message: str) -> None:
    print(f"[bench_detection] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="fasterrcnn_mobilenet_v3_large_320_fpn")
    parser.add_argument("--image-size", type=int, default=128, help="data.image_size")
    parser.add_argument("--images", type=int, default=16, help="training images generated")
    parser.add_argument("--val-images", type=int, default=6, help="validation images (mAP)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per side a round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the photos go (default: a temp dir)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table as docs/benchmarks.md holds it (date, commit, machine) at the end",
    )
    parser.add_argument("--check", action="store_true", help=f"exit 1 below the {FLOOR} floor")
    args = parser.parse_args(argv)
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: a run that proves it works
        args.image_size, args.rounds, args.steps, args.images = 64, 1, 1, 8
    if min(args.rounds, args.steps, args.batch_size, args.threads, args.images - 3) < 1:
        parser.error("--rounds, --steps, --batch-size, --threads >= 1 and --images >= 4")
    return args


def total_steps(args) -> int:
    """Step 1, the warm-up round and the timed rounds, on each side."""
    return 1 + (args.rounds + 1) * args.steps


def kiln_config(folder, args, cache: Path):
    return load_config(
        [
            "data=coco",
            "model=torchvision_detection",
            f"model.arch={args.arch}",
            f"data.train_json={folder.train_json}",
            f"data.train_images={folder.train_images}",
            f"data.val_json={folder.val_json}",
            f"data.val_images={folder.val_images}",
            f"data.cache_dir={cache}",
            f"data.image_size={args.image_size}",
            f"data.batch_size={args.batch_size}",
            "data.num_workers=0",
            f"seed={args.seed}",
            # the schedule spans the bench's steps exactly (both sides build it from this)
            f"trainer.max_steps={total_steps(args)}",
            "trainer.max_epochs=100000",
            "logger=none",
            "device=cpu",
            "trainer.log_every_n_steps=1000000",  # no log line inside the timed steps
            "env.progress_bar=false",
        ]
    )


class ReferenceLoop:
    """torchvision's train_one_epoch, one step at a time, on the bare torchvision module."""

    def __init__(self, net: torch.nn.Module, cfg, planned_steps: int):
        self.model = net
        params = [p for p in net.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, cfg.optimizer)
        self.lr_scheduler = build_scheduler(self.optimizer, cfg.scheduler, planned_steps)

    def step(self, batch) -> dict[str, float]:
        images, targets = batch
        self.model.train()
        images = [image for image in images]  # .to(device): CPU here
        targets = [{k: v for k, v in t.items()} for t in targets]
        loss_dict = self.model(images, targets)
        losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()  # reduce_dict over one process: the dict itself
        if not math.isfinite(loss_value):
            raise SystemExit(f"Loss is {loss_value}, stopping training: {loss_dict}")
        self.optimizer.zero_grad()
        losses.backward()
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        # metric_logger.update(loss=losses_reduced, **loss_dict_reduced): each read to the host
        logged = {"loss": loss_value, **{k: v.item() for k, v in loss_dict.items()}}
        logged["lr"] = self.optimizer.param_groups[0]["lr"]
        return logged


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        folder = make_photo_boxes(work / "photos", num_train=args.images, num_val=args.val_images)
        cfg = kiln_config(folder, args, work / "cache")
        trainer = build_run(
            cfg, work / "run", DistInfo(), torch.device("cpu"), lambda metrics, step: None
        ).trainer
        bundle = build_data(cfg.data)
        spec = bundle.spec
        val = bundle.collate_fn([bundle.val[i] for i in range(len(bundle.val))])
        twin = build_model(spec, cfg.model)  # the same builder, then kiln's initial weights
        twin.load_state_dict(trainer.raw_model.state_dict())
        reference = ReferenceLoop(twin.net, cfg, trainer.state.planned_steps)
        loader = trainer.train_loader
        batches, epoch = [], 0
        while len(batches) < total_steps(args):  # the same batches for both sides, in order
            loader.sampler.set_epoch(epoch)
            batches += list(loader)
            epoch += 1
        batches = batches[: total_steps(args)]
        images_per_batch = [len(images) for images, _ in batches]

        def kiln_steps(indices) -> dict:
            result = None
            for i in indices:
                result = trainer.train_step(iter([batches[i]]), 1)
                trainer.state.global_step += 1
                trainer.after_step(result, None)
            return result

        def reference_steps(indices) -> dict:
            logged = None
            for i in indices:
                logged = reference.step(batches[i])
            return logged

        torch.manual_seed(args.seed)  # proposals and RoI samples are drawn at random
        kiln_first = kiln_steps([0])
        torch.manual_seed(args.seed)
        reference_first = reference_steps([0])
        step1 = {
            key: {"kiln": float(kiln_first.terms[key]), "reference": reference_first[key]}
            for key in trainer.raw_model.loss_keys
        }
        for value in step1.values():
            value["relative_difference"] = abs(value["kiln"] - value["reference"]) / max(
                abs(value["reference"]), 1e-12
            )
        same = all(v["relative_difference"] <= LOSS_TOLERANCE for v in step1.values())
        progress(f"step 1 losses {'agree' if same else 'DIFFER'}: {step1}")

        rates: dict[str, list[float]] = {"kiln": [], "reference": []}
        maps: dict[str, list[dict]] = {"kiln": [], "reference": []}
        sides = {"kiln": kiln_steps, "reference": reference_steps}
        networks = {"kiln": trainer.raw_model, "reference": twin.net}
        for round_ in range(args.rounds + 1):  # round 0: warm-up
            indices = range(1 + round_ * args.steps, 1 + (round_ + 1) * args.steps)
            count = sum(images_per_batch[i] for i in indices)
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            measured = {}
            for name in order:
                start = time.perf_counter()
                sides[name](indices)
                measured[name] = count / (time.perf_counter() - start)
            if round_:
                for name, rate in measured.items():
                    rates[name].append(rate)
                    maps[name].append(validation_map(networks[name], val, spec.class_names))
                progress(
                    f"round {round_}: kiln {measured['kiln']:.2f} images/s, mAP@.5 "
                    f"{maps['kiln'][-1]['map_50']:.3f}; reference {measured['reference']:.2f} "
                    f"images/s, mAP@.5 {maps['reference'][-1]['map_50']:.3f}"
                )
    ratios = [k / r for k, r in zip(rates["kiln"], rates["reference"], strict=True)]
    median = statistics.median(ratios)
    return {
        "arch": args.arch,
        "image_size": args.image_size,
        "images": args.images,
        "batch_size": args.batch_size,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "optimizer": cfg.optimizer.name,
        "step1_losses": step1,
        "step1_losses_agree": same,
        "kiln_images_per_s": rates["kiln"],
        "reference_images_per_s": rates["reference"],
        "val_images": len(val[0]),
        "steps_after_round": [1 + (r + 1) * args.steps for r in range(1, args.rounds + 1)],
        "kiln_map": maps["kiln"],
        "reference_map": maps["reference"],
        "ratios": ratios,
        "median_ratio": median,
        "spread": [min(ratios), max(ratios)],
        "floor": FLOOR,
        "meets_floor": median >= FLOOR,
    }


@torch.no_grad()
def validation_map(net: torch.nn.Module, val, class_names) -> dict[str, float]:
    """mAP and mAP@.5 of a network (kiln's wrapper or torchvision's module: the same eval
    forward) on the validation photos; its train mode given back."""
    from kiln.inference.detection_report import detection_metrics

    images, targets = val
    net.eval()
    try:
        found = net(list(images))
    finally:
        net.train()
    detections = [{k: v.numpy() for k, v in d.items()} for d in found]
    truth = [{k: v.numpy() for k, v in t.items()} for t in targets]
    metrics = detection_metrics(detections, truth, class_names)
    return {"map": metrics["map"] or 0.0, "map_50": metrics["map_50"] or 0.0}


def table(result: dict) -> str:
    low, high = result["spread"]
    setting = (
        f"{result['arch']} at {result['image_size']} px, {result['images']} training photos, "
        f"batch {result['batch_size']}, optimizer={result['optimizer']}, {result['threads']} "
        f"thread(s), {result['rounds']} rounds of {result['steps_per_round']} steps a side"
    )
    rows = [
        setting,
        "",
        "| loop | images/s (median) | min | max |",
        "|---|---:|---:|---:|",
        _row("kiln (Trainer.train_step)", result["kiln_images_per_s"]),
        _row("torchvision reference train_one_epoch", result["reference_images_per_s"]),
        f"| ratio kiln / reference | {result['median_ratio']:.2f} | {low:.2f} | {high:.2f} |",
        "",
        f"validation mAP over the rounds, on {result['val_images']} photos:",
        "",
        "| after step | kiln mAP@.5 | reference mAP@.5 | kiln mAP | reference mAP |",
        "|---:|---:|---:|---:|---:|",
    ]
    for step, ours, theirs in zip(
        result["steps_after_round"], result["kiln_map"], result["reference_map"], strict=True
    ):
        rows.append(
            f"| {step} | {ours['map_50']:.3f} | {theirs['map_50']:.3f} | "
            f"{ours['map']:.3f} | {theirs['map']:.3f} |"
        )
    rows += [
        "",
        "| step 1 loss | kiln | reference | relative difference |",
        "|---|---:|---:|---:|",
    ]
    for key, value in result["step1_losses"].items():
        rows.append(
            f"| {key} | {value['kiln']:.6f} | {value['reference']:.6f} | "
            f"{value['relative_difference']:.1e} |"
        )
    rows += [
        "",
        f"step 1 losses {'agree' if result['step1_losses_agree'] else 'DIFFER'} "
        f"(within {LOSS_TOLERANCE:g}); floor {result['floor']}: "
        f"{'met' if result['meets_floor'] else 'MISSED'}",
    ]
    return "\n".join(rows)


def _row(name: str, rates: list[float]) -> str:
    return f"| {name} | {statistics.median(rates):.2f} | {min(rates):.2f} | {max(rates):.2f} |"


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
    if not result["step1_losses_agree"]:
        return 1  # not the same training: the ratio compares nothing
    return 1 if args.check and not result["meets_floor"] else 0


if __name__ == "__main__":
    sys.exit(main())
