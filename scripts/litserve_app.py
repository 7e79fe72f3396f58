"""The LitServe app of a kiln checkpoint: scripts/loadtest.py's peer (`--peers litserve`). Runs in
the bench-only venv that loadtest.py makes (litserve is not in kiln's install), on the same
checkpoint, the same preprocessing and the same request body as kiln's /v1/predict:

    POST /predict {"inputs": [<one input>, ...]} -> {"predictions": [{"label", "probs"}, ...]}

LitServe as its documentation sets it up: one inference worker process beside its HTTP server,
with --threads torch threads (loadtest.py gives kiln's default), and its own batching when
--max-batch-size > 1.

    .bench/litserve/bin/python scripts/litserve_app.py --ckpt run/checkpoints/best.pt --port 8001
"""

from __future__ import annotations

import argparse

import litserve as ls


class KilnCheckpointAPI(ls.LitAPI):
    def __init__(self, ckpt: str, threads: int | None, **options):
        super().__init__(**options)
        self.ckpt, self.threads = ckpt, threads

    def setup(self, device):
        from kiln.inference import Predictor

        self.predictor = Predictor.from_checkpoint(self.ckpt, threads=self.threads)

    def decode_request(self, request):
        return self.predictor.convert(request["inputs"])

    def batch(self, inputs):
        from kiln.inference.predictor import join

        return join(inputs)

    def predict(self, items):
        return self.predictor.run(items)

    def unbatch(self, output):
        return [output[i : i + 1] for i in range(len(output))]

    def encode_response(self, output):
        return {"predictions": self.predictor.answers(output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=1)
    parser.add_argument("--batch-timeout-s", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (None: all)")
    args = parser.parse_args()
    api = KilnCheckpointAPI(
        args.ckpt,
        args.threads,
        max_batch_size=args.max_batch_size,
        batch_timeout=args.batch_timeout_s,
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
