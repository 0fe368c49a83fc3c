"""occlusion_manifests -> visualchat_model (+ its three blocking checks) -> registered_visualchat, in process,
with a tiny CLIP and a tiny GPT-2 (built from configs, loaded through from_pretrained) on real
Fashion-MNIST images, 2 processes under ZeRO-2 on gloo through the launcher; then the registered model
answers through MLflow and the chat CLI's `models:/` resolution, a failing VQA check keeps the alias
where it was, and bad input fails at once naming the file, line or field. The demo profile's lineage
(`decoder_asset: gpt_checkpoint`, and the merged model as the adapter's backbone) runs in `test_main_job`."""

import json
import re
from importlib.metadata import version
from pathlib import Path

import dagster as dg
import mlflow
import pandas as pd
import pytest

from vlm_assets.defs.data.occlusion_assets import occlusion_manifests
from vlm_assets.defs.models.visualchat_assets import registered_visualchat, visualchat_model
from vlm_assets.defs.platform.storage import ArtifactStoreResource
from vlm_assets.models.registry import SERVING_PACKAGES
from vlm_assets.train.run_config import overlay
from vlm_assets_tests.conftest import IsolatedEnv, checks_of
from vlm_assets_tests.models.visualchat_fixtures import tiny_clip, tiny_decoder, tiny_model_section

pytestmark = pytest.mark.slow

GRAPH = [occlusion_manifests, visualchat_model, registered_visualchat]  # checks: in the assets' steps


# This module tests the registration and serving around the VQA gate, not the gate's passing side: a
# tiny model trained four steps names no class, so no threshold above 0 can pass here. The passing
# side with the demo's real threshold (and a margin) is test_main_job's; the refusing side is below (1.0).
def run_config(offline_data: Path, models: Path, visualchat=None, min_exact_match=0.0) -> dict:
    return {
        "ops": {
            "occlusion_manifests": {
                "config": {
                    "source": "fashion_mnist",
                    "source_uri": str(offline_data / "fashion-mnist"),
                    "num_train": 60,
                    "num_validation": 20,
                }
            },
            "visualchat_model": {
                "config": overlay(
                    {
                        "model": tiny_model_section(models / "clip", models / "gpt2"),
                        "optimizer": {"global_batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "max_steps": 4},
                        "data": {"pair_count": 8, "eval_images": 8},
                        "checkpoint": {"every": 2},
                        "parallelism": {"nproc_per_node": 2, "micro_batch_size": 2},
                        "log_every": 2,
                        "timeout_s": 600,
                        "checks": {"min_exact_match": min_exact_match},
                    },
                    visualchat or {},
                )
            },
        }
    }


def meta(result, asset):
    materializations = result.asset_materializations_for_node(asset)
    return {k: getattr(v, "value", v) for k, v in materializations[0].metadata.items()} if materializations else None


@pytest.fixture(scope="module")
def models(tmp_path_factory, offline_data) -> Path:
    root = tmp_path_factory.mktemp("models")
    tiny_clip(root / "clip")
    tiny_decoder(root / "gpt2", offline_data, arch="gpt2")
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, offline_data, models):
    env = IsolatedEnv(tmp_path_factory.mktemp("visualchat"), GRAPH)
    return env, env.materialize(run_config(offline_data, models))


def test_trains_merges_evaluates_and_registers(pipeline):
    from vlm_assets.evaluate.visualchat_eval import HELD_OUT_PHRASINGS

    env, result = pipeline
    assert result.success
    checks = checks_of(result, "visualchat_model")
    assert checks == {
        "eval_loss_beats_untrained": True,
        "vqa_exact_match_meets_threshold": True,
        "merged_equals_unmerged": True,
    }
    model = meta(result, "visualchat_model")
    assert model["cache"] == "miss" and model["steps"] == 4 and model["vqa_images"] == 8 and model["vqa_chance"] == 0.1
    assert model["merge_max_abs_diff"] < 1e-4 and model["eval_loss"] < model["baseline_eval_loss"]
    root = Path(model["uri"])
    evaluation = json.loads((root / "eval.json").read_text())
    template, phrased = evaluation["vqa"]["template"], evaluation["vqa"]["held_out_phrasings"]
    assert len(template["predictions"]) == 8 and len(phrased["predictions"]) == 8
    assert {p["question"] for p in phrased["predictions"]} == set(HELD_OUT_PHRASINGS[:5])
    low, high = template["ci95"]
    assert low < template["exact_match"] < high or template["exact_match"] in (0.0, 1.0)
    assert model["vqa_exact_match_ci95_low"] == low
    assert [m["role"] for m in evaluation["conversation"]] == ["user", "assistant", "user", "assistant"]
    assert "| assistant |" in model["conversation"] and model["loss_curve"].startswith("![loss curve](data:image/png")
    assert (root / "model" / "visualchat.json").is_file() and (root / "loss_curve.png").is_file()
    registered = meta(result, "registered_visualchat")
    assert registered["model"] == "models:/visualchat@champion" and registered["registry"] == "registered"


def test_the_registered_model_answers_through_mlflow_and_the_chat_cli(pipeline, offline_data):
    from vlm_assets.chat import resolve_model
    from vlm_assets.models.visualchat_pyfunc import example_png

    env, _ = pipeline
    mlflow.set_tracking_uri(env.uri)
    model = mlflow.pyfunc.load_model("models:/visualchat@champion")
    answers = model.predict(
        pd.DataFrame(
            {
                "question": ["What is shown?", "Which one is a Bag?"],
                "images": [[example_png()], [example_png(), example_png()]],
            }
        )
    )
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    directory = resolve_model("models:/visualchat@champion")
    assert (directory / "visualchat.json").is_file() and (directory / "decoder" / "config.json").is_file()
    # the requirements are the pins written at registration, not MLflow's inference (which adds scikit-learn)
    requirements = Path(mlflow.pyfunc.get_model_dependencies("models:/visualchat@champion")).read_text().split()
    pinned = {line.split("==")[0]: line.split("==")[1] for line in requirements}
    assert sorted(pinned) == sorted(SERVING_PACKAGES), requirements
    # the installed distributions' versions (a CUDA wheel's torch.__version__ adds "+cu130": pip's is without)
    assert all(pinned[name] == version(name) for name in SERVING_PACKAGES), requirements


def test_the_chat_cli_the_registered_pyfunc_and_the_eval_answer_a_png_file_alike(pipeline, offline_data, tmp_path):
    """One preprocessing path: a held-out Fashion-MNIST image saved as a PNG file, asked the same
    question through the chat CLI (stdin), `models:/visualchat@champion` (base64 PNG) and the eval's
    `answer` (the file's path) gives one answer."""
    import base64
    import subprocess
    import sys

    from PIL import Image

    from vlm_assets.chat import resolve_model
    from vlm_assets.data.image_sources import load_fashion_mnist
    from vlm_assets.evaluate.visualchat_eval import answer
    from vlm_assets.models.visualchat import VisualChatModel

    env, _ = pipeline
    png = tmp_path / "boot.png"
    Image.fromarray(load_fashion_mnist(offline_data / "fashion-mnist").eval.images[-1].squeeze()).save(png)
    question = "What is this?"
    mlflow.set_tracking_uri(env.uri)
    pyfunc = mlflow.pyfunc.load_model("models:/visualchat@champion").predict(
        pd.DataFrame({"question": [question], "images": [[base64.b64encode(png.read_bytes()).decode()]]})
    )[0]
    directory = resolve_model("models:/visualchat@champion")
    messages = [{"role": "user", "content": [{"type": "image", "image": str(png)}, {"type": "text", "text": question}]}]
    evaluated = answer(VisualChatModel.from_pretrained(directory), messages, [str(png)])  # 8 new tokens, as the pyfunc
    cli = subprocess.run(
        [sys.executable, "-m", "vlm_assets.chat", str(directory), "--max-new-tokens", "8"],
        input=f"/image {png}\n{question}\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    # What the CLI streamed after its one "visualchat> ", up to its next prompt (an answer may hold newlines).
    turns = cli.stdout.split("visualchat> ")
    assert len(turns) == 2, cli.stdout + cli.stderr[-2000:]
    said = turns[1].split("you> ")[0].strip()
    assert said == evaluated and pyfunc == evaluated, (said, pyfunc, evaluated)

    # The same champion served over HTTP, as `mlflow models serve` users run it.
    from vlm_assets_tests.conftest import mlflow_serve

    b64 = base64.b64encode(png.read_bytes()).decode()
    with mlflow_serve("models:/visualchat@champion", env.uri, tmp_path / "serve.log") as post:
        status, body = post({"dataframe_records": [{"question": question, "images": [b64]}]})
        assert status == 200 and body["predictions"] == [evaluated], body
        status, body = post({"dataframe_records": [{"question": question, "images": [b64, "%%%"]}]})
        assert status == 400 and "row 0: field 'images': not base64" in body["message"], body
        status, body = post({"dataframe_records": [{"question": question, "images": ["aGVsbG8="]}]})
        assert status == 400 and "row 0: field 'images': not a readable image" in body["message"], body
        status, body = post({"dataframe_records": [{"images": [b64]}]})
        assert status == 400 and "question" in body["message"], body  # MLflow's own schema check


def test_a_rerun_hits_the_cache_and_a_failing_vqa_check_keeps_the_alias(pipeline, offline_data, models):
    env, first = pipeline
    again = env.materialize(run_config(offline_data, models))
    assert meta(again, "visualchat_model")["cache"] == "hit"
    assert meta(again, "registered_visualchat")["registry"] == "already current"
    strict = env.materialize(run_config(offline_data, models, min_exact_match=1.0), raise_on_error=False)
    checks = checks_of(strict, "visualchat_model")
    assert checks["vqa_exact_match_meets_threshold"] is False and meta(strict, "visualchat_model")["cache"] == "hit"
    assert meta(strict, "registered_visualchat") is None  # blocked by the failed check
    mlflow.set_tracking_uri(env.uri)
    assert str(mlflow.MlflowClient().get_model_version_by_alias("visualchat", "champion").version) == "1"


def _failure(result) -> str:
    return "\n".join(e.step_failure_data.error.message for e in result.all_events if e.is_step_failure)


def test_bad_input_fails_at_once_naming_the_file_line_or_field(pipeline, offline_data, models, tmp_path):
    env, _ = pipeline
    missing = tmp_path / "nope.jsonl"
    result = env.materialize(
        run_config(offline_data, models, {"data": {"chat_datasets": {str(missing): None}}}), raise_on_error=False
    )
    assert f"config field data.chat_datasets: {missing} does not exist" in _failure(result)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "robot", "content": "hi"}]})
        + "\n"
    )
    result = env.materialize(
        run_config(offline_data, models, {"data": {"chat_datasets": {str(bad): None}}}), raise_on_error=False
    )
    assert f"{bad}:2: unknown role 'robot'" in _failure(result)
    llava = tmp_path / "llava.json"  # every bad record is named, not only the first; nothing is trained
    llava.write_text(
        json.dumps(
            [
                {
                    "image": "gone.png",
                    "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}],
                },
                {"conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}]},
            ]
        )
    )
    result = env.materialize(
        run_config(offline_data, models, {"data": {"chat_datasets": {str(llava): None}}}), raise_on_error=False
    )
    assert f"{llava}:1: image file {tmp_path / 'gone.png'} does not exist" in _failure(result)
    assert f"{llava}:2: 1 <image> marker(s) for 0 image(s): they must match" in _failure(result)
    assert not result.asset_materializations_for_node("visualchat_model")
    long = tmp_path / "long.jsonl"  # found by the trainer (it needs the tokenizer): no retry either
    long.write_text(
        json.dumps({"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]})
        + "\n"
    )
    result = env.materialize(
        run_config(offline_data, models, {"data": {"chat_datasets": {str(long): None}}}), raise_on_error=False
    )
    assert re.search(rf"{re.escape(str(long))}:1: \d+ tokens .*more than max_length 256", _failure(result)), _failure(
        result
    )
    assert not [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    result = env.materialize(run_config(offline_data, models, {"parallelism": {"zero_stage": 1}}), raise_on_error=False)
    assert "field parallelism.zero_stage: zero_stage 1 is not supported" in _failure(result)
    result = env.materialize(
        run_config(offline_data, models, {"model": {"decoder": str(tmp_path / "no-decoder")}}), raise_on_error=False
    )
    assert f"config field model.decoder: directory {tmp_path / 'no-decoder'} does not exist" in _failure(result)


def test_every_bad_chat_record_of_every_format_fails_the_asset_naming_it(pipeline, offline_data, models, tmp_path):
    """The inspector's bad files (OpenAI, LLaVA, Parquet rows, Parquet columns) through the asset: each
    fails at once, no retry, nothing trained, and the failure names every bad record as FILE:N."""
    import shutil

    from vlm_assets_tests.data.test_chat_formats import BAD_OPENAI, bad_columns, bad_llava, bad_parquet, write_jsonl

    env, _ = pipeline
    folder = tmp_path / "images"
    folder.mkdir()
    images = [Path(shutil.copy(f, folder)) for f in sorted((offline_data / "cifar10-samples").glob("*.png"))[:4]]
    openai = write_jsonl(folder / "bad.jsonl", *[record for record, _ in BAD_OPENAI])
    expected_openai = [f"{openai}:{n}: " for n in range(1, len(BAD_OPENAI) + 1)]
    for path, expected in (
        (openai, expected_openai),
        bad_llava(images),
        bad_parquet(images, tmp_path),
        bad_columns(tmp_path),
    ):
        result = env.materialize(
            run_config(offline_data, models, {"data": {"chat_datasets": {str(path): None}}}), raise_on_error=False
        )
        failure = _failure(result)
        assert "ChatDataError" in failure, failure
        for start in expected:
            assert start in failure, (start, failure)
        assert not result.asset_materializations_for_node("visualchat_model")
        assert not [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]


def test_a_deps_upstream_is_read_from_this_run_before_a_newer_one_elsewhere(embedded, offline_data):
    """`decoder: gpt_checkpoint` and `backbone: visualchat` read their upstream through `read_artifact`:
    this run's materialization of it wins over a newer one of another run (another config)."""
    from vlm_assets.defs.platform.storage import read_artifact

    def manifests(num_train):
        return {
            "ops": {
                "occlusion_manifests": {
                    "config": {
                        "source": "fashion_mnist",
                        "source_uri": str(offline_data / "fashion-mnist"),
                        "num_train": num_train,
                        "num_validation": 10,
                    }
                }
            }
        }

    other = embedded.materialize([occlusion_manifests], manifests(20))
    other_key = meta(other, "occlusion_manifests")["cache_key"]

    @dg.asset(deps=[occlusion_manifests])
    def interloper(context: dg.AssetExecutionContext):  # another run's newer materialization, meanwhile
        context.instance.report_runless_asset_event(
            dg.AssetMaterialization("occlusion_manifests", metadata={"cache_key": other_key})
        )

    @dg.asset(deps=[interloper])
    def reader(context: dg.AssetExecutionContext, artifact_store: ArtifactStoreResource) -> dg.MaterializeResult:
        store, asset = artifact_store.get_store(), dg.AssetKey("occlusion_manifests")
        return dg.MaterializeResult(
            metadata={"read": read_artifact(context.instance, context.run, store, asset, "reader").key}
        )

    result = embedded.materialize([occlusion_manifests, interloper, reader], manifests(30))
    assert meta(result, "reader")["read"] == meta(result, "occlusion_manifests")["cache_key"] != other_key
    latest = embedded.instance.get_latest_materialization_event(dg.AssetKey("occlusion_manifests"))
    assert latest.asset_materialization.metadata["cache_key"].value == other_key
