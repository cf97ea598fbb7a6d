#!/usr/bin/env python
"""KServe's own Python clients (``kserve.InferenceRESTClient`` with protocol v2, ``InferenceGRPCClient``)
against a running ``gpuloom serve``: JSON and binary tensors over REST, raw tensors over gRPC, health and
readiness. Outputs are compared with the example repository's ``tiny_mlp`` computed in numpy from its
safetensors weights. Run it with KServe's interpreter (the kserve package is not a gpuloom dependency):

    gpuloom serve examples/repository &
    /tmp/ksv/bin/python scripts/check_kserve_client.py --http 127.0.0.1:8000 --grpc 127.0.0.1:8001

Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def tiny_mlp_reference(x: np.ndarray) -> np.ndarray:
    """tiny_mlp (Linear 16->32, ReLU, Linear 32->4) in numpy, from its shipped safetensors file, read
    here by its format (an 8-byte header length, a JSON header, the raw tensors): KServe's environment
    need not have the safetensors package."""
    import json

    raw = (ROOT / "examples" / "repository" / "tiny_mlp.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    w = {k: np.frombuffer(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]], dtype="<f4").reshape(v["shape"])
         for k, v in header.items() if k != "__metadata__"}
    h = np.maximum(x @ w["net.0.weight"].T + w["net.0.bias"], 0.0)
    return h @ w["net.2.weight"].T + w["net.2.bias"]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", default="127.0.0.1:8000")
    ap.add_argument("--grpc", default="127.0.0.1:8001")
    a = ap.parse_args()
    sys.argv = sys.argv[:1]  # kserve parses the command line when imported (its model server's flags)
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    results = {}
    rest = InferenceRESTClient(config=RESTConfig(protocol="v2"))
    base = f"http://{a.http}"
    results["rest live"] = await rest.is_server_live(base)
    results["rest model ready"] = await rest.is_model_ready(base, "tiny_mlp")
    outs = {}
    for binary in (False, True):
        inp = InferInput(name="x", shape=list(x.shape), datatype="FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        res = await rest.infer(base, InferRequest(model_name="tiny_mlp", infer_inputs=[inp]), model_name="tiny_mlp")
        outs[f"rest {'binary' if binary else 'json'}"] = res.outputs[0].as_numpy()
    await rest.close()
    grpc = InferenceGRPCClient(a.grpc)
    results["grpc live"] = await grpc.is_server_live()
    results["grpc model ready"] = await grpc.is_model_ready("tiny_mlp")
    inp = InferInput(name="x", shape=list(x.shape), datatype="FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    res = await grpc.infer(InferRequest(model_name="tiny_mlp", infer_inputs=[inp]))
    outs["grpc"] = res.outputs[0].as_numpy()
    await grpc.close()
    ref = tiny_mlp_reference(x)
    for name, y in outs.items():
        results[f"{name}: outputs equal tiny_mlp's in numpy"] = y.shape == ref.shape and np.allclose(y, ref, atol=1e-5)
    for k, ok in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {k}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
