"""The registered form of the occlusion adapter: an MLflow pyfunc predictor (image + box -> label).

Logged with MLflow's models-from-code (``adapter_model.py`` is the model's code; nothing is pickled).
Artifacts: ``adapter.safetensors`` (the 10,532 weights) and ``backbone.json`` (the frozen backbone's
hub id or path, recorded, not copied: it is gigabytes and unchanged). ``predict`` takes a DataFrame
with ``image`` (PNG bytes, base64) and ``box`` ([x0, y0, x1, y1] in image pixels) and returns labels,
through the same ``preprocess`` as training and evaluation.
"""

import base64
import io

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from PIL import Image

from vlm_assets.data.occlusion_dataset import decode_png, preprocess


class OcclusionAdapterPredictor(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from vlm_assets.models.frozen_vlm import load_backbone
        from vlm_assets.models.occlusion_adapter import load_adapter

        self.adapter, info = load_adapter(context.artifacts["adapter"], context.artifacts["backbone"])
        self.prompt, self.image_size = info["prompt"], info["image_size"]
        self.backbone = load_backbone(info["backbone"], max_length=info["max_length"])

    # A DataFrame hint: MLflow then validates against the signature logged with the model (a base64
    # PNG column and a box column, eval_assets) instead of inferring one from the hint.
    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        triples = [
            preprocess(decode_png(base64.b64decode(image)), box, self.image_size)
            for image, box in zip(model_input["image"], model_input["box"])
        ]
        occluded, masks = torch.stack([t[0] for t in triples]), torch.stack([t[2] for t in triples])
        with torch.no_grad():
            restored = self.adapter(occluded, masks)
        return [a.strip() for a in self.backbone.generate(restored, [self.prompt] * len(triples))]


def png_b64(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels.squeeze()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
