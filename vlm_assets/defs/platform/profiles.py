"""Run profiles as config defaults, so every way of launching an asset uses the active profile.

``seed`` = the defaults written in the config classes (official CIFAR-10, wikitext-103, gpt2 from the
hub, full-size training). ``demo`` = the real offline data of ``scripts/fetch-offline-data.sh`` at
small scale; its values replace those defaults when the code location loads with
``VLM_ASSETS_PROFILE=demo`` (the default). Because they are the config classes' defaults, `main_job`,
the UI's "Materialize" buttons, `dagster asset materialize` and the schedule all run the same thing,
and a value given in run config still wins. A demo value a field rejects fails the load, naming it.
"""

from pathlib import Path
from typing import Any

import dagster as dg
import pydantic

from vlm_assets.defs.platform.environment import profile
from vlm_assets.paths import offline_data_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples"  # package data (pyproject.toml)


def profile_defaults(name: str) -> dict[str, dict[str, Any]]:
    """Config class name -> field defaults of the profile (empty for ``seed``)."""
    if name == "seed":
        return {}
    return _demo(offline_data_dir())


def _demo(data: Path) -> dict[str, dict[str, Any]]:
    return {
        "OcclusionManifestsConfig": {
            "source": "fashion_mnist",
            "source_uri": str(data / "fashion-mnist"),
            "num_train": 2000,
            "num_validation": 500,
        },
        "TokenShardsConfig": {
            "source": "text_files",
            "text_glob": str(data / "shakespeare" / "*.txt"),
            "tokenizer": str(data / "gpt2-tokenizer"),
            "max_length": 256,
        },
        # Two nodes of one process each (two torchrun agents on loopback), as a cluster would run it.
        "GPTCheckpointConfig": {
            "preset": "tiny",
            "strategy": "ddp",
            "num_nodes": 2,
            "nproc_per_node": 1,
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "lr": 3e-3,
            "warmup_steps": 5,
            "max_steps": 40,
            "val_check_interval": 20,
            "val_batches": 8,
            "checkpoint_every": 20,
            "log_every": 10,
        },
        # VisualChat on the graph's own GPT: the pretrained EfficientNet-Lite0 (frozen, its features cached),
        # an mlp projection, and the decoder with LoRA, trained with it (40 steps of Shakespeare teach a
        # decoder too little for LoRA alone), on the clean images as VQA (the manifest's prompt, and 400
        # asked in other words) and two-image conversations, plus a small LLaVA-format file of real
        # CIFAR-10 photos (24 conversations; README "Chat datasets").
        "VisualChatAssetConfig": {
            "chat_datasets": {str(EXAMPLES / "cifar10_llava.json"): None},
            "image_folder": str(data / "cifar10-samples"),
            "decoder": "gpt_checkpoint",
            "encoder_kind": "efficientnet_lite0",
            "encoder": None,  # the packaged ImageNet weights
            "projection": "mlp",
            "freeze_modules": ["encoder"],
            "cache_image_features": True,
            "max_length": 256,
            "vqa_count": 800,
            "pair_count": 100,
            "phrasing_count": 400,
            "eval_fraction": 0.05,
            "micro_batch_size": 8,
            "global_batch_size": 16,
            "nproc_per_node": 2,
            "lr": 3e-3,
            "warmup_steps": 10,
            "max_steps": 300,
            "eval_images": 100,
            "checkpoint_every": 150,
            "log_every": 50,
        },
        "VQACheckConfig": {"min_exact_match": 0.3},  # visualchat_model's checks section
        # The adapter at the images' own 28 px in front of that VisualChat model (frozen), on 2 processes:
        # 6 weight-tied steps (a 12 px reach: the whole box), 10 epochs of reconstruction (it learns to
        # inpaint; no backbone). The LM loss is left out here: on this lineage it shuts the gate (README,
        # "Why the adapter helps"). The frozen model judges the adapter in eval_report.
        "OcclusionAdapterConfig": {
            "backbone": "visualchat",
            "image_size": 28,
            "adapter_steps": 6,
            "epochs": 10,
            "reconstruction_warmup_epochs": 10,
            "reconstruction_loss_weight": 1.0,
            "reconstruction_outside_box": True,
            "lr": 1e-2,
            "micro_batch_size": 8,
            "global_batch_size": 16,
            "nproc_per_node": 2,
            "num_train": None,
            "num_validation": 200,
        },
        "EvalReportConfig": {"num_samples": 500, "batch_size": 50, "num_cards": 24},
        # eval_report's checks section: changing a threshold judges the same report again, never rebuilds it.
        "EvalChecksConfig": {"min_accuracy": 0.3},
    }


class ProfileDefaults(pydantic.BaseModel):
    """Mixed into asset and check configs: the active profile's values become the field defaults."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        overrides = profile_defaults(profile()).get(cls.__name__)
        if not overrides:
            return
        from vlm_assets.train.run_config import describe_validation_error

        for field, value in overrides.items():
            if field not in cls.model_fields:
                raise ValueError(f"profile {profile()!r}: {cls.__name__} has no field {field!r}")
            cls.model_fields[field].default = value
        cls.model_rebuild(force=True)
        try:  # defaults are not validated by pydantic: validate the profile's once, here
            cls.model_validate(overrides)
        except pydantic.ValidationError as err:
            raise ValueError(
                describe_validation_error(err, f"profile {profile()!r}: config of {cls.__name__}")
            ) from None
        except dg.Failure as err:  # an AssetConfig turns its validation errors into step failures
            raise ValueError(f"profile {profile()!r}: {err.description}") from None
