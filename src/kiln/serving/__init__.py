"""HTTP serving of a kiln Predictor. Only inference imports this; training never pulls in the
web stack.

    app.py      the FastAPI app: routes, the batcher, metrics, the OpenAPI document
    v1.py       kiln's API (/v1/predict, /healthz, /readyz, /metrics)
    v2.py       Open Inference Protocol v2 routes; oip.py its wire format (JSON and binary)
    state.py    admission, body limits, deadlines, clients that leave
    decoding.py image files decoded off the event loop: a bounded, fair pool of threads
    batcher.py  fair dynamic batching with failure isolation
    server.py   uvicorn with a drain on SIGTERM
    openapi.py  the document of every status and body
    metrics.py  Prometheus metrics and the middleware counting every answer"""

from kiln.serving.app import create_app
from kiln.serving.server import serve

__all__ = ["create_app", "serve"]
