"""Run the app under uvicorn (`python infer.py mode=serve ...`)."""

from __future__ import annotations

import uvicorn

from kiln.inference import Predictor
from kiln.serving.app import create_app


def serve(
    predictor: Predictor,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch_size: int = 32,
    max_delay_ms: float = 5,
    max_queue_size: int = 1024,
    model_name: str = "kiln",
) -> None:
    app = create_app(
        predictor,
        max_batch_size=max_batch_size,
        max_delay_ms=max_delay_ms,
        max_queue_size=max_queue_size,
        model_name=model_name,
    )
    print(f"serving {model_name} on http://{host}:{port} (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
