"""The registered form of VisualChat: an MLflow pyfunc (a question and images -> the greedy answer).

Logged with models-from-code (``visualchat_model_code.py``). Its one artifact, ``model``, is the merged
model directory (``VisualChatModel.save_pretrained``), which ``python -m vlm_assets.chat models:/...``
downloads and chats with. ``predict`` takes a DataFrame with ``question`` (text) and ``images`` (a list
of base64 PNGs, in order) and returns one answer per row.
"""

import io
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from PIL import Image


class VisualChatPredictor(mlflow.pyfunc.PythonModel):
    """The MLflow pyfunc serving a VisualChat model: a question and its images in, the reply out."""

    def load_context(self, context) -> None:
        """Load the VisualChat model from the model's artifacts."""
        from vlm_assets.models.visualchat import VisualChatModel

        self.model = VisualChatModel.from_pretrained(context.artifacts["model"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        """Return the model's reply to each row's question about its base64 images."""
        from vlm_assets.data.visualchat_data import to_pixels
        from vlm_assets.models.adapter_pyfunc import bad_request, decode_b64_image

        size = self.model.encoder.image_size
        answers = []
        for row, (question, images) in enumerate(zip(model_input["question"], model_input["images"])):
            if not isinstance(question, str) or not question.strip():
                raise bad_request(row, "question", "must be non-empty text")
            if isinstance(images, str) or not hasattr(images, "__iter__"):
                raise bad_request(row, "images", "must be a list of base64 images")
            pixels = [
                decode_b64_image(b64, row, "images", lambda data: to_pixels(Image.open(io.BytesIO(data)), size))
                for b64 in images
            ]
            content = [{"type": "image", "image": ""} for _ in pixels] + [{"type": "text", "text": question}]
            answers.append(
                self.model.reply([{"role": "user", "content": content}], torch.stack(pixels) if pixels else None)
            )
        return answers


def example_png() -> str:
    """Return a mid-grey 28 x 28 PNG, base64: the logged input example."""
    from vlm_assets.models.adapter_pyfunc import png_b64

    return png_b64(np.full((28, 28, 3), 128, np.uint8))


def log_model(run_id: str, root: Path, tracking_uri: str):
    """Log the predictor of the VisualChat artifact ``root`` (its ``model/``) into the MLflow run ``run_id``.

    Return its ``ModelInfo``.
    """
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Schema

    from vlm_assets.models.registry import log_pyfunc

    return log_pyfunc(
        run_id,
        tracking_uri,
        Path(__file__).with_name("visualchat_model_code.py"),
        ModelSignature(
            inputs=Schema([ColSpec("string", "question"), ColSpec(Array("string"), "images")]),
            outputs=Schema([ColSpec("string", "answer")]),
        ),
        pd.DataFrame({"question": ["What is shown?"], "images": [[example_png()]]}),
        {"model": str(root / "model")},
    )
