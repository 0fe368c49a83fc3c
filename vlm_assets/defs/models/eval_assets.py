"""``eval_report`` (accuracy with and without the adapter, HTML report) and ``registered_adapter``
(the MLflow Model Registry entry, whose ``champion`` alias moves only when the eval checks pass)."""

import json
from pathlib import Path

import dagster as dg
import torch
from pydantic import Field
from safetensors.torch import load_file

from vlm_assets.defs.platform.memo import AssetConfig, Built, materialize_memoized
from vlm_assets.defs.platform.storage import ArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource, TrackedRun
from vlm_assets.storage import ArtifactRef


class EvalReportConfig(AssetConfig):
    num_samples: int | None = Field(default=None, ge=1, description="Validation images evaluated (unset = all).")
    batch_size: int = Field(default=16, ge=1, description="Images per batched greedy decode.")
    num_cards: int = Field(default=24, ge=0, description="Prediction cards in the HTML report.")


class AccuracyCheckConfig(dg.Config):
    min_accuracy: float = Field(default=0.5, ge=0, le=1, description=(
        "Exact-match accuracy with the adapter must reach this (a check setting: changing it re-runs the check only)."))


def load_trained(store, adapter_ref: ArtifactRef):
    from vlm_assets.models.frozen_vlm import QwenVLBackbone
    from vlm_assets.models.occlusion_adapter import OcclusionAdapter

    root = store.local_path(adapter_ref.key)
    info = json.loads((root / "backbone.json").read_text())
    backbone = QwenVLBackbone(info["backbone"], max_length=info["max_length"])
    adapter = OcclusionAdapter()
    adapter.load_state_dict(load_file(str(root / "adapter.safetensors")))
    return backbone, adapter, info, root


@dg.asset(code_version="1", kinds={"pytorch", "html"}, group_name="models")
def eval_report(context: dg.AssetExecutionContext, config: EvalReportConfig, occlusion_adapter: ArtifactRef,
                occlusion_manifests: ArtifactRef, artifact_store: ArtifactStoreResource,
                mlflow: MlflowTrackingResource) -> dg.Output[ArtifactRef]:
    """Greedy decoding on the validation split: exact-match (and the seed's lenient) accuracy with the
    adapter, without it (identity) on the same occluded images, and on the clean images; per-class
    accuracy, confusion matrix, and ``report.html`` (self-contained: curves, tables, prediction cards)."""
    from vlm_assets.evaluate.occlusion_eval import evaluate
    from vlm_assets.evaluate.report import accuracy_png, data_uri, html_report, markdown_table
    from vlm_assets.train.adapter_module import OcclusionSamples, class_names

    upstream = {"occlusion_adapter": occlusion_adapter, "occlusion_manifests": occlusion_manifests}
    store = artifact_store.get_store()

    def build(staging: Path, run: TrackedRun) -> Built:
        backbone, adapter, info, root = load_trained(store, occlusion_adapter)
        manifests = store.local_path(occlusion_manifests.key)
        data = OcclusionSamples(manifests, "validation", info["image_size"], None)
        result = evaluate(backbone, adapter, data, class_names(manifests), count=config.num_samples,
                          batch_size=config.batch_size)
        summary = result.summary()
        cards = []
        with torch.no_grad():
            for i in range(min(config.num_cards, len(result.labels))):
                item = data[i]
                cards.append({"occluded": item["occluded"], "clean": item["clean"], "label": item["answer"],
                              "restored": adapter(item["occluded"][None], item["mask"][None])[0],
                              "predictions": {c: result.predictions[c][i] for c in result.predictions}})
        epochs = json.loads((root / "history.json").read_text())["epochs"]
        (staging / "report.html").write_text(html_report(result, epochs, cards, "Occlusion adapter evaluation"))
        (staging / "eval.json").write_text(json.dumps({**summary, "per_class": {c: result.per_class(c) for c in result.predictions},
                                                       "confusion_adapter": result.confusion("adapter").tolist()}))
        with open(staging / "predictions.jsonl", "w") as f:
            for i, y in enumerate(result.labels):
                f.write(json.dumps({"label": result.class_names[y], **{c: result.predictions[c][i] for c in result.predictions}}) + "\n")
        run.log_artifact(str(staging / "report.html"))
        run.log_artifact(str(staging / "eval.json"))
        return Built(metrics=summary,
                     markdown={"summary": markdown_table(summary),
                               "accuracy": f"![accuracy]({data_uri(accuracy_png(summary))})"})

    return materialize_memoized(context, store=store, mlflow=mlflow, config=config, build=build, upstream=upstream)


@dg.asset_check(asset=eval_report, blocking=True)
def adapter_accuracy_meets_threshold(config: AccuracyCheckConfig, eval_report: ArtifactRef) -> dg.AssetCheckResult:
    """Exact-match accuracy with the adapter is at least ``min_accuracy`` (this check's config)."""
    accuracy, bound = eval_report.metadata["metrics"]["accuracy_adapter"], config.min_accuracy
    return dg.AssetCheckResult(passed=bool(accuracy >= bound), description=f"accuracy {accuracy:.1%} vs threshold {bound:.1%}",
                               metadata={"accuracy_adapter": accuracy, "min_accuracy": bound})


@dg.asset_check(asset=eval_report, blocking=True)
def adapter_gain_non_negative(eval_report: ArtifactRef) -> dg.AssetCheckResult:
    """The adapter does not hurt: accuracy with it >= without it, on the same occluded images."""
    gain = eval_report.metadata["metrics"]["adapter_gain"]
    return dg.AssetCheckResult(passed=bool(gain >= 0), description=f"adapter gain {gain:+.1%}", metadata={"adapter_gain": gain})


class RegisteredAdapterConfig(AssetConfig):
    model_name: str = Field(default="occlusion_adapter", description="MLflow registered model name.")
    alias: str = Field(default="champion", description="Alias moved to the new version.")


@dg.asset(code_version="1", kinds={"mlflow"}, group_name="models", deps=[eval_report])
def registered_adapter(context: dg.AssetExecutionContext, config: RegisteredAdapterConfig,
                       occlusion_adapter: ArtifactRef, artifact_store: ArtifactStoreResource,
                       mlflow: MlflowTrackingResource) -> dg.Output[ArtifactRef]:
    """The adapter as an MLflow pyfunc model (image + box -> label; adapter weights as safetensors, the
    backbone recorded) in the Model Registry, with ``champion`` moved to it. Downstream of the blocking
    eval checks: it never runs when they fail. Load it with ``mlflow.pyfunc.load_model('models:/<name>@champion')``."""
    import mlflow as mlflow_lib

    from vlm_assets.models.adapter_pyfunc import OcclusionAdapterPredictor

    upstream = {"occlusion_adapter": occlusion_adapter}
    store = artifact_store.get_store()

    def build(staging: Path, run: TrackedRun) -> Built:
        root = store.local_path(occlusion_adapter.key)
        mlflow_lib.set_tracking_uri(mlflow.tracking_uri)
        mlflow_lib.set_registry_uri(mlflow.tracking_uri)
        with mlflow_lib.start_run(run_id=run.run_id):
            info = mlflow_lib.pyfunc.log_model(
                name="model", python_model=OcclusionAdapterPredictor(),
                artifacts={"adapter": str(root / "adapter.safetensors"), "backbone": str(root / "backbone.json")},
                registered_model_name=config.model_name)
        client = mlflow.client()
        version = info.registered_model_version
        client.set_registered_model_alias(config.model_name, config.alias, version)
        (staging / "registration.json").write_text(json.dumps({"name": config.model_name, "version": version,
                                                               "alias": config.alias, "model_uri": info.model_uri}))
        context.log.info(f"registered {config.model_name} v{version}, alias {config.alias} -> v{version}")
        return Built(metrics={"version": float(version)},
                     metadata={"model": f"models:/{config.model_name}@{config.alias}", "model_version": str(version)})

    return materialize_memoized(context, store=store, mlflow=mlflow, config=config, build=build, upstream=upstream)
