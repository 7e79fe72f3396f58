"""Models: each registered builder takes (DataSpec, ModelConfig) and never hard-codes a shape.

Classification models return logits (N, num_classes), or a dict {"logits": ..., "aux_logits": ...}
when built with an auxiliary head."""

from kiln.models import detector, mlp, resnet, text  # noqa: F401  (registration side effects)
from kiln.models.init import apply_init
from kiln.registry import MODELS


def build_model(spec, cfg, *, aux_head: bool | None = None):
    """Build a registered model from the data spec. `aux_head` overrides cfg.aux_head."""
    want_aux = cfg.aux_head if aux_head is None else aux_head
    model = MODELS.get(cfg.name)(spec, cfg, aux_head=want_aux)
    apply_init(model, cfg.init)
    return model


__all__ = ["build_model", "apply_init"]
