"""The registered form of the occlusion adapter: an MLflow pyfunc predictor (image + box -> label).

Artifacts: ``adapter.safetensors`` (the 10,532 weights) and ``backbone.json`` (the frozen backbone's
hub id or path, recorded, not copied: it is gigabytes and unchanged). ``predict`` takes a DataFrame
with ``image`` (PNG bytes, base64) and ``box`` ([x0, y0, x1, y1] in image pixels) and returns labels.
"""

import base64
import io
import json

import mlflow.pyfunc
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


class OcclusionAdapterPredictor(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from safetensors.torch import load_file

        from vlm_assets.models.frozen_vlm import QwenVLBackbone
        from vlm_assets.models.occlusion_adapter import OcclusionAdapter

        info = json.loads(open(context.artifacts["backbone"]).read())
        self.prompt, self.image_size = info["prompt"], info["image_size"]
        self.backbone = QwenVLBackbone(info["backbone"], max_length=info["max_length"])
        self.adapter = OcclusionAdapter()
        self.adapter.load_state_dict(load_file(context.artifacts["adapter"]))
        self.adapter.eval()

    def _tensors(self, png_b64: str, box) -> tuple[torch.Tensor, torch.Tensor]:
        image = Image.open(io.BytesIO(base64.b64decode(png_b64))).convert("RGB")
        clean = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        x0, y0, x1, y1 = (int(v) for v in box)
        mask = torch.zeros(1, *clean.shape[1:])
        mask[:, y0:y1, x0:x1] = 1.0
        size = (self.image_size, self.image_size)
        pixels = F.interpolate((clean * (1 - mask))[None], size=size, mode="bilinear", antialias=True)[0].clamp(0, 1)
        return pixels, F.interpolate(mask[None], size=size, mode="nearest")[0]

    def predict(self, context, model_input, params=None) -> list[str]:
        pairs = [self._tensors(img, box) for img, box in zip(model_input["image"], model_input["box"])]
        pixels, masks = torch.stack([p for p, _ in pairs]), torch.stack([m for _, m in pairs])
        with torch.no_grad():
            restored = self.adapter(pixels, masks)
        return [a.strip() for a in self.backbone.generate(restored, [self.prompt] * len(pairs))]


def png_b64(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels.squeeze()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
