"""Schemathesis hooks for the runs in test_serving_openapi.py (loaded by SCHEMATHESIS_HOOKS).

One rule of the Open Inference Protocol is a relation JSON Schema cannot state: a tensor's data
holds exactly prod(shape) values. Schema-valid cases generated without it are not valid requests,
so positive cases of the v2 infer operations are made to obey it (the batch size is set from
the data generated); negative cases are left as generated."""

from __future__ import annotations

import math

import schemathesis


@schemathesis.hook
def map_case(ctx, case):
    if not case.operation.path.endswith("/infer") or case.meta is None:
        return case
    if not case.meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return case
    for tensor in case.body.get("inputs") or []:
        shape, data = tensor.get("shape"), tensor.get("data")
        if not (isinstance(shape, list) and shape and isinstance(data, list)):
            continue
        per_input = math.prod(shape[1:])
        nested = bool(data) and isinstance(data[0], list)
        count = len(data) if nested or per_input == 0 else len(data) // per_input
        tensor["shape"] = [count, *shape[1:]]
        if not nested:
            tensor["data"] = data[: count * per_input]
    return case
