"""VisualChat's MLflow model code (models-from-code): MLflow runs this file to build the model, so the
registry holds code and weights, never a pickled Python object."""

from mlflow.models import set_model

from vlm_assets.models.visualchat_pyfunc import VisualChatPredictor

set_model(VisualChatPredictor())
