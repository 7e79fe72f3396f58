"""`python infer.py key=value ...` / `kiln-infer`: predict a file, export to ONNX, or serve.

    python infer.py ckpt=run/checkpoints/best.pt input=x.npy output=preds.csv [backend=onnx]
    python infer.py mode=export ckpt=run/checkpoints/best.pt [int8=true]
    python infer.py mode=serve ckpt=run/checkpoints/best.pt [server.port=8000 ...]

A user mistake (missing file, bad shape, unknown key or mode, a refused checkpoint) ends with one
`error: ...` line on stderr and exit status 2."""

from __future__ import annotations

import logging
import sys

from kiln.errors import UserError
from kiln.inference.config import ArgumentError, InferConfig, parse_args, usage
from kiln.inference.errors import InputError

EXIT_USER_ERROR = 2
USER_ERRORS = (UserError, ArgumentError, FileNotFoundError, ValueError)


def run_predict(cfg: InferConfig) -> None:
    from kiln.inference import Predictor
    from kiln.inference.files import read_inputs, write_predictions

    predictor = Predictor.from_checkpoint(cfg.ckpt, cfg.backend, cfg.device, cfg.int8)
    inputs = read_inputs(cfg.input, predictor.preprocess, cfg.text_column)
    try:
        probs = predictor.predict_probs(inputs, batch_size=cfg.batch_size)
    except InputError as err:
        raise InputError(f"{cfg.input}: {err}", err.index) from None
    path = write_predictions(probs, predictor.class_names, cfg.output)
    print(f"wrote {len(probs)} predictions to {path} ({cfg.backend} backend)", flush=True)


def run_export(cfg: InferConfig) -> None:
    from kiln.inference import export

    report = export(cfg.ckpt, int8=cfg.int8, device=cfg.device)
    print("\n".join(report.lines()), flush=True)


def run_serve(cfg: InferConfig) -> None:
    from kiln.inference import Predictor
    from kiln.serving import serve  # only this mode pulls in the web stack

    predictor = Predictor.from_checkpoint(cfg.ckpt, cfg.backend, cfg.device, cfg.int8)
    s = cfg.server
    serve(
        predictor,
        host=s.host,
        port=s.port,
        max_batch_size=s.max_batch_size,
        max_delay_ms=s.max_delay_ms,
        max_queue_size=s.max_queue_size,
        model_name=s.model_name,
    )


RUNNERS = {"predict": run_predict, "export": run_export, "serve": run_serve}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(usage())
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
        RUNNERS[cfg.mode](cfg)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
