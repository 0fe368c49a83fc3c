"""Run profiles as config defaults, so every way of launching an asset uses the active profile.

``seed`` = the defaults written in the config classes (official CIFAR-10, wikitext-103, gpt2 from the
hub, full-size training). ``demo`` = the real offline data of ``scripts/fetch-offline-data.sh`` at
small scale; its values replace those defaults when the code location loads with
``VLM_ASSETS_PROFILE=demo`` (the default). Because they are the config classes' defaults, `main_job`,
the UI's "Materialize" buttons, `dagster asset materialize` and the schedule all run the same thing,
and a value given in run config still wins. A profile is data keyed by asset name (``<asset>.checks``
for an asset's checks section); each config class claims its key (``profile_key``), and a key no
class claims or a value a field rejects fails the load, naming it.
"""

import enum
from pathlib import Path
from typing import Any, ClassVar

import dagster as dg
import pydantic

from vlm_assets.defs.platform.environment import profile
from vlm_assets.paths import offline_data_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples"  # package data (pyproject.toml)


def profile_defaults(name: str) -> dict[str, dict[str, Any]]:
    """Asset name (``<asset>.checks`` for its checks section) -> field defaults of the profile (empty for
    ``seed``)."""
    if name == "seed":
        return {}
    return _demo(offline_data_dir())


def _demo(data: Path) -> dict[str, dict[str, Any]]:
    return {
        "occlusion_manifests": {
            "source": "fashion_mnist",
            "source_uri": str(data / "fashion-mnist"),
            "num_train": 2000,
            "num_validation": 500,
        },
        "token_shards": {
            "source": "text_files",
            "text_glob": str(data / "shakespeare" / "*.txt"),
            "tokenizer": str(data / "gpt2-tokenizer"),
            "max_length": 256,
        },
        # Two nodes of one process each (two torchrun agents on loopback), as a cluster would run it.
        "gpt_checkpoint": {
            "model": {"preset": "tiny"},
            "optimizer": {"global_batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "max_steps": 40},
            "data": {"val_check_interval": 20, "val_batches": 8},
            "checkpoint": {"every": 20},
            "parallelism": {"strategy": "ddp", "num_nodes": 2, "nproc_per_node": 1, "micro_batch_size": 4},
            "log_every": 10,
        },
        # VisualChat on the graph's own GPT: the pretrained EfficientNet-Lite0 (frozen, its features cached),
        # an mlp projection, and the decoder with LoRA, trained with it (40 steps of Shakespeare teach a
        # decoder too little for LoRA alone), on the clean images as VQA (the manifest's prompt, and 400
        # asked in other words) and two-image conversations, plus a small LLaVA-format file of real
        # CIFAR-10 photos (24 conversations; README "Chat datasets"). 400 steps: at 300 the demo's own seed
        # stopped short (VQA 53 %, the adapter's gain +2.8 [-0.8, +6.2] pts: README "Measured").
        "visualchat_model": {
            "decoder_asset": "gpt_checkpoint",
            "model": {
                "encoder_kind": "efficientnet_lite0",
                "encoder": None,  # the packaged ImageNet weights
                "projection": "mlp",
                "freeze_modules": ["encoder"],
                "max_length": 256,
            },
            "optimizer": {"global_batch_size": 16, "lr": 3e-3, "warmup_steps": 10, "max_steps": 400},
            "data": {
                "chat_datasets": {str(EXAMPLES / "cifar10_llava.json"): None},
                "image_folder": str(data / "cifar10-samples"),
                "vqa_count": 800,
                "pair_count": 100,
                "phrasing_count": 400,
                "eval_fraction": 0.05,
                "eval_images": 100,
            },
            "checkpoint": {"every": 200},
            "parallelism": {"nproc_per_node": 2, "micro_batch_size": 8, "cache_image_features": True},
            "log_every": 50,
        },
        "visualchat_model.checks": {"min_exact_match": 0.3},
        # The adapter at the images' own 28 px in front of that VisualChat model (frozen), on 2 processes:
        # 6 weight-tied steps (a 12 px reach: the whole box), 10 epochs of reconstruction (it learns to
        # inpaint; no backbone). The LM loss is left out here: on this lineage it shuts the gate (README,
        # "Why the adapter helps"). The frozen model judges the adapter in eval_report.
        "occlusion_adapter": {
            "backbone_asset": "visualchat_model",
            "model": {"adapter_steps": 6},
            "optimizer": {
                "global_batch_size": 16,
                "lr": 1e-2,
                "epochs": 10,
                "reconstruction_warmup_epochs": 10,
                "reconstruction_loss_weight": 1.0,
                "reconstruction_outside_box": True,
            },
            "data": {"image_size": 28, "num_train": None, "num_validation": 200},
            "parallelism": {"nproc_per_node": 2, "micro_batch_size": 8},
        },
        "eval_report": {"num_samples": 500, "batch_size": 50, "num_cards": 24},
        # Changing a threshold judges the same report again, never rebuilds it.
        "eval_report.checks": {"min_accuracy": 0.3},
    }


# Values a profile sets for its own data source hold only while the asset reads that source: a user who
# points the asset at another one (another ``source`` or ``source_uri``; a ``model.decoder`` or
# ``model.backbone`` of their own) gets the fields' own defaults for them (every image of their folder,
# not the demo's 2,000 Fashion-MNIST ones; their decoder, not the graph's GPT). Dagster hands a config its
# schema's defaults as if given, so a value equal to the profile's is taken as the profile's. Fields are
# dotted paths into the config's sections.
SOURCE_TIED = {
    "occlusion_manifests": (("source", "source_uri"), ("num_train", "num_validation")),
    "visualchat_model": (("model.decoder",), ("decoder_asset",)),
    "occlusion_adapter": (("model.backbone",), ("backbone_asset",)),
}
_CLAIMED: set[str] = set()
# class -> (the profile's source values, {tied field: (the profile's value, the field's own default)})
_TIED: dict[type, tuple[dict[str, Any], dict[str, tuple[Any, Any]]]] = {}
_MISSING = object()


def _get(data: Any, path: str, default: Any = _MISSING) -> Any:
    """The value at a dotted path of nested dicts, or ``default``."""
    for part in path.split("."):
        if isinstance(data, pydantic.BaseModel):  # a section Dagster built already
            data = data.model_dump()
        if not isinstance(data, dict) or part not in data:
            return default
        data = data[part]
    return data


def _field_default(cls: type[pydantic.BaseModel], path: str) -> Any:
    *sections, field = path.split(".")
    for name in sections:
        cls = cls.model_fields[name].annotation
    return cls.model_fields[field].default


def _patch_defaults(
    cls: type[pydantic.BaseModel], values: dict[str, Any], where: str, at: tuple[str, ...] = ()
) -> None:
    """Make ``values`` the field defaults of ``cls``; a dict for a section (a model-typed field) patches
    that section's own class (each asset's sections are its own: ``training.dagster_config``), and is
    validated there: Dagster drops a section's values equal to its defaults before pydantic sees them."""
    for field, value in values.items():
        if field not in cls.model_fields:
            raise ValueError(f"profile {profile()!r}: {where} has no field {'.'.join((*at, field))!r}")
        annotation = cls.model_fields[field].annotation
        if isinstance(value, dict) and isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            _patch_defaults(annotation, value, where, (*at, field))
            try:
                annotation.model_validate(value)
            except pydantic.ValidationError as err:
                from vlm_assets.train.run_config import describe_validation_error

                raise ValueError(
                    describe_validation_error(err, f"profile {profile()!r}: config of {where}", (*at, field))
                ) from None
        else:
            cls.model_fields[field].default = value
    cls.model_rebuild(force=True)


class ProfileDefaults(pydantic.BaseModel):
    """Mixed into asset and check configs: the active profile's values under ``profile_key`` become the
    field defaults."""

    profile_key: ClassVar[str | None] = None  # the asset's name, or "<asset>.checks"

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        key = cls.__dict__.get("profile_key")  # its own, never a parent's
        if key is None:
            return
        _CLAIMED.add(key)
        overrides = profile_defaults(profile()).get(key)
        if not overrides:
            return
        from vlm_assets.train.run_config import describe_validation_error

        sources, tied = SOURCE_TIED.get(key, ((), ()))
        own = {field: cls.model_fields[field].default for field in tied if field in overrides}
        _patch_defaults(cls, overrides, f"{key} ({cls.__name__})")
        if own:
            _TIED[cls] = (
                {path: _field_default(cls, path) for path in sources},
                {field: (overrides[field], default) for field, default in own.items()},
            )
        try:  # defaults are not validated by pydantic: validate the profile's once, here
            validated = cls.model_validate(overrides)
        except pydantic.ValidationError as err:
            raise ValueError(
                describe_validation_error(err, f"profile {profile()!r}: config of {key} ({cls.__name__})")
            ) from None
        except dg.Failure as err:  # an AssetConfig turns its validation errors into step failures
            raise ValueError(f"profile {profile()!r}: {key}: {err.description}") from None
        # An enum's default as its member, not the profile's string (which pydantic warns of at every dump).
        if enums := {f: v for f in overrides if isinstance(v := getattr(validated, f), enum.Enum)}:
            _patch_defaults(cls, enums, key)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _profile_values_follow_its_source(cls, data: Any) -> Any:
        if (tied := _TIED.get(cls)) is None or not isinstance(data, dict):
            return data
        sources, values = tied
        if all(_get(data, path, value) == value for path, value in sources.items()):
            return data
        return {**data, **{f: own for f, (profiled, own) in values.items() if data.get(f, profiled) == profiled}}


def check_profile_claimed() -> None:
    """Every key of the active profile names a config that claims it: a misspelt or renamed asset fails
    the load instead of silently dropping its profile."""
    if unclaimed := sorted(set(profile_defaults(profile())) - _CLAIMED):
        claimed = ", ".join(sorted(_CLAIMED))
        raise ValueError(f"profile {profile()!r}: no asset config claims {', '.join(unclaimed)} (claimed: {claimed})")
