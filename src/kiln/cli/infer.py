"""`python infer.py key=value ...` / `kiln-infer`: predict a file, export to ONNX, or serve.

    python infer.py ckpt=run/checkpoints/best.pt input=x.npy output=preds.csv [backend=onnx]
    python infer.py ckpt=run/checkpoints/best.pt input=photos/test   # image files, recursively
    python infer.py mode=export ckpt=run/checkpoints/best.pt [int8=true | format=triton]
    python infer.py mode=serve ckpt=run/checkpoints/best.pt [server.port=8000 ...]
    python infer.py mode=evaluate ckpt=run/checkpoints/best.pt [data=<folder or .csv>]

A user mistake (missing file, bad shape, unknown key or mode, a refused checkpoint) ends with one
`error: ...` line on stderr and exit status 2."""

from __future__ import annotations

import logging
import sys

from kiln.config.infer import InferConfig, model_threads, parse_args, usage
from kiln.errors import UserError

EXIT_USER_ERROR = 2


def run_predict(cfg: InferConfig) -> None:
    from kiln.inference import InputError, Predictor
    from kiln.inference.files import (
        FileListing,
        predictable_texts,
        read_inputs,
        split_named,
        write_detections,
    )
    from kiln.inference.tables import write_predictions

    output = cfg.output or "preds.csv"
    predictor = Predictor.from_checkpoint(
        cfg.ckpt, cfg.backend, cfg.device, cfg.int8, "auto", batch_size=cfg.batch_size
    )
    inputs = read_inputs(
        cfg.input, predictor.preprocess, cfg.text_column, follow_symlinks=cfg.follow_symlinks
    )
    if isinstance(inputs, FileListing):
        return predict_files(cfg, predictor, inputs, output)
    # Named inputs (a detector's .npz or .npy): (name, array) pairs.
    sources, inputs = split_named(inputs)
    skipped = None
    if predictor.preprocess.input_kind == "tokens":
        inputs, skipped = predictable_texts(inputs, predictor.preprocess)
    try:
        outputs = predictor.run_in_chunks(inputs, batch_size=cfg.batch_size)
    except InputError as err:
        where = f" ({sources[err.index]})" if sources and err.index is not None else ""
        raise InputError(f"{cfg.input}{where}: {err}", err.index) from None
    if predictor.task == "detection":
        path = write_detections(outputs, sources, predictor.class_names, output)
        found = sum(len(d["boxes"]) for d in outputs)
        print(f"wrote {found} boxes for {len(outputs)} images to {path} ({cfg.backend} backend)")
        return
    path = write_predictions(
        outputs, predictor.class_names, output, sources, skipped, multi_label=predictor.multi_label
    )
    print(f"wrote {len(outputs)} predictions to {path} ({cfg.backend} backend)", flush=True)
    if skipped:
        total = len(outputs) + len(skipped)
        print(
            f"{len(skipped)} of {total} inputs were empty after cleaning: no prediction, see "
            f"the error column of {path}",
            flush=True,
        )


def predict_files(cfg: InferConfig, predictor, listing, output: str) -> None:
    """Input files (a folder, a glob, one file), read and predicted one batch at a time; a
    file that cannot be predicted gets a row with its error (strict=true: stops at it)."""
    from functools import partial

    from kiln.inference import InputError
    from kiln.inference.files import load_file_input
    from kiln.inference.stream import predict_files_to_csv

    if listing.skipped:
        print(f"{cfg.input}: skipped {listing.skipped_line()}", flush=True)
    load = partial(load_file_input, predictor.preprocess, max_image_pixels=cfg.max_image_pixels)
    outcome = predict_files_to_csv(
        predictor, listing.files, output, load=load, batch_size=cfg.batch_size, strict=cfg.strict
    )
    what = f"{outcome.boxes} boxes for " if outcome.boxes is not None else ""
    unit = "images" if outcome.boxes is not None else "predictions"
    print(
        f"wrote {what}{outcome.predicted} {unit} to {outcome.path} ({cfg.backend} backend)",
        flush=True,
    )
    if cfg.draw:
        draw_boxes(cfg, predictor, listing, outcome.path)
    if outcome.failed:
        reasons = ", ".join(f"{n} {reason}" for reason, n in outcome.errors.items())
        message = (
            f"{outcome.failed} of {outcome.inputs} inputs could not be predicted ({reasons}): "
            f"see the error column of {outcome.path}"
        )
        if not outcome.predicted:
            raise InputError(f"{cfg.input}: none of the inputs could be predicted; {message}")
        print(f"warning: {message}", file=sys.stderr, flush=True)


def draw_boxes(cfg: InferConfig, predictor, listing, csv_path) -> None:
    """draw=true: each predicted image with its boxes, beside the CSV."""
    from pathlib import Path

    from kiln.inference import InputError
    from kiln.inference.detection_pictures import draw_detections_csv

    if predictor.task != "detection":
        raise InputError("draw=true draws a detector's boxes; this model is a classifier")
    csv_path = Path(csv_path)
    out_dir = csv_path.with_name(f"{csv_path.stem}_boxes")
    drawn = draw_detections_csv(csv_path, listing.files, out_dir, max_pixels=cfg.max_image_pixels)
    print(f"drew the boxes on {drawn} images in {out_dir}", flush=True)


def run_export(cfg: InferConfig) -> None:
    if cfg.format == "triton":
        from kiln.inference.triton import export_triton

        report = export_triton(
            cfg.ckpt,
            cfg.export_dir,
            model_name=cfg.server.model_name,
            max_batch_size=cfg.server.max_batch_size,
            max_delay_ms=cfg.server.max_delay_ms,
            device=cfg.device,
        )
    else:
        from kiln.inference.export import export

        report = export(cfg.ckpt, int8=cfg.int8, device=cfg.device)
    print("\n".join(report.lines()), flush=True)


def run_serve(cfg: InferConfig) -> None:
    from kiln.inference import Predictor
    from kiln.serving import serve  # only this mode pulls in the web stack

    threads = model_threads(cfg.server.model_threads)
    predictor = Predictor.from_checkpoint(
        cfg.ckpt,
        cfg.backend,
        cfg.device,
        cfg.int8,
        threads,
        batch_size=cfg.server.max_batch_size,
        reserve=1,  # a core for HTTP
    )
    serve(predictor, cfg.server)


def run_evaluate(cfg: InferConfig) -> None:
    from kiln.inference.evaluate import evaluate_checkpoint

    report = evaluate_checkpoint(
        cfg.ckpt,
        data=cfg.data,
        output=cfg.output,
        split=cfg.split,
        backend=cfg.backend,
        device=cfg.device,
        batch_size=cfg.batch_size,
        num_errors=cfg.num_errors,
        max_image_pixels=cfg.max_image_pixels,
        follow_symlinks=cfg.follow_symlinks,
    )
    print("\n".join(report.lines()), flush=True)


RUNNERS = {
    "predict": run_predict,
    "export": run_export,
    "serve": run_serve,
    "evaluate": run_evaluate,
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(usage())
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
        if cfg.plugins:  # the user's modules, named here: a checkpoint never names what runs
            from kiln.registry import load_plugins

            load_plugins(cfg.plugins)
        if cfg.mode == "serve":  # the server drains on SIGTERM and Ctrl-C (kiln.serving)
            run_serve(cfg)
        else:
            stoppable(RUNNERS[cfg.mode], cfg, argv)
    except UserError as err:  # a bug (kiln's or a plugin's) is a traceback and exit 1
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def stoppable(run, cfg: InferConfig, argv: list[str]) -> None:
    """`run(cfg)`, ended at once by SIGTERM, SIGUSR1 or Ctrl-C (kiln.engine.preemption): every
    file it writes is written whole or not at all, so a stop leaves none half-written (an
    export's model.onnx included). One line and exit 75 (130 for Ctrl-C)."""
    from kiln.commands import infer
    from kiln.engine.preemption import SIGNALS, Interrupted, Preempted, exit_code

    def say(stop: BaseException) -> None:
        how = "interrupted (Ctrl-C)" if isinstance(stop, Interrupted) else "preempted"
        line = f"infer.py mode={cfg.mode} {how}: no file was left half-written; run it again"
        print(f"{line} with: {infer(*argv)}", file=sys.stderr, flush=True)

    with SIGNALS.installed(), SIGNALS.last_word(say):
        try:
            run(cfg)
        except Preempted as stop:
            say(stop)
            raise SystemExit(exit_code(stop)) from None
