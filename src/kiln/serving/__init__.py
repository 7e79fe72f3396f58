"""HTTP serving of a kiln Predictor: FastAPI + a dynamic batcher + Prometheus metrics.
Only inference imports this; training never pulls in the web stack."""

from kiln.serving.app import create_app
from kiln.serving.server import serve

__all__ = ["create_app", "serve"]
