"""The registered form of the occlusion adapter: an MLflow pyfunc predictor (image + box -> label).

Logged with MLflow's models-from-code (``adapter_model.py`` is the model's code; nothing is pickled).
Artifacts: ``adapter.safetensors`` (the 10,532 weights) and ``backbone.json`` (the frozen backbone's
hub id or path, recorded, not copied: it is gigabytes and unchanged). ``predict`` takes a DataFrame
with ``image`` (PNG bytes, base64) and ``box`` ([x0, y0, x1, y1] in image pixels) and returns labels,
through the same ``preprocess`` as training and evaluation.
"""

import base64
import io
import json
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from PIL import Image

from vlm_assets.data.occlusion_dataset import decode_png, preprocess


class OcclusionAdapterPredictor(mlflow.pyfunc.PythonModel):
    """The MLflow pyfunc serving an occlusion adapter: an image and a box in, the backbone's answer out."""

    def load_context(self, context) -> None:
        """Load the backbone and the adapter from the model's artifacts."""
        from vlm_assets.models.occlusion_adapter import load_trained

        self.backbone, self.adapter, info = load_trained(context.artifacts["adapter"], context.artifacts["backbone"])
        self.prompt, self.image_size = info["prompt"], info["image_size"]

    # A DataFrame hint: MLflow then validates against the signature logged with the model (a base64
    # PNG column and a box column, ``log_model``) instead of inferring one from the hint.
    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        """Restore each occluded image with the adapter and return the backbone's answers."""
        triples = []
        for row, (image, box) in enumerate(zip(model_input["image"], model_input["box"])):
            pixels = decode_b64_image(image, row, "image", decode_png)
            try:
                triples.append(preprocess(pixels, box, self.image_size))
            except (ValueError, TypeError) as err:
                raise bad_request(row, "box", f"{err} (expected [x0, y0, x1, y1] in image pixels)") from None
        occluded, masks = torch.stack([t[0] for t in triples]), torch.stack([t[2] for t in triples])
        with torch.no_grad():
            restored = self.adapter(occluded, masks)
        return [a.strip() for a in self.backbone.generate(restored, [self.prompt] * len(triples))]


def bad_request(row: int, field: str, reason: str):
    """Return the error the scoring server answers with HTTP 400 (not a 500 and a traceback), naming the field."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    return MlflowException(f"row {row}: field '{field}': {reason}", error_code=INVALID_PARAMETER_VALUE)


def decode_b64_image(value, row: int, field: str, decode):
    """Return ``decode(bytes)`` of a base64 image field; raise ``bad_request`` naming the row and field otherwise."""
    try:
        data = base64.b64decode(value, validate=True)
    except (ValueError, TypeError) as err:
        raise bad_request(row, field, f"not base64 ({err})") from None
    try:
        return decode(data)
    except Exception as err:  # Pillow's errors for a payload that is not an image vary by format
        raise bad_request(row, field, f"not a readable image ({type(err).__name__}: {err})") from None


def png_b64(pixels: np.ndarray) -> str:
    """Encode an image array as a base64 PNG."""
    buf = io.BytesIO()
    Image.fromarray(pixels.squeeze()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def log_model(run_id: str, root: Path, tracking_uri: str):
    """Log the predictor of the adapter artifact ``root`` into the MLflow run ``run_id``; return its ``ModelInfo``.

    Its input example: a mid-grey PNG at the training size with a box in its middle.
    """
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Schema

    from vlm_assets.models.registry import log_pyfunc

    side = json.loads((root / "backbone.json").read_text())["image_size"]
    return log_pyfunc(
        run_id,
        tracking_uri,
        Path(__file__).with_name("adapter_model.py"),
        ModelSignature(
            inputs=Schema([ColSpec("string", "image"), ColSpec(Array("long"), "box")]),
            outputs=Schema([ColSpec("string", "label")]),
        ),
        pd.DataFrame(
            {
                "image": [png_b64(np.full((side, side, 3), 128, np.uint8))],
                "box": [[side // 4, side // 4, side // 2, side // 2]],
            }
        ),
        {"adapter": str(root / "adapter.safetensors"), "backbone": str(root / "backbone.json")},
    )
