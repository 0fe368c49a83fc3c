"""``occlusion_manifests``: images with one seeded black rectangle each, and its data-quality checks."""

from typing import Literal, Self

import dagster as dg
from pydantic import Field, model_validator

from vlm_assets.data import occlusion_checks
from vlm_assets.data.image_sources import load_source
from vlm_assets.data.occlusion import BoxBounds, write_occlusion_manifests
from vlm_assets.data.preview import occlusion_preview
from vlm_assets.defs.platform.checks import CHECKS_SECTION, Judged
from vlm_assets.defs.platform.memo import AssetConfig, Built, Step, memoized_asset
from vlm_assets.defs.platform.profiles import ProfileDefaults
from vlm_assets.paths import cache_dir
from vlm_assets.storage import ArtifactRef
from vlm_assets.train.run_config import step_field


class BalanceCheckConfig(ProfileDefaults, dg.Config):
    """Settings of the ``occlusion_manifests`` class-balance check."""

    profile_key = "occlusion_manifests.checks"

    balance_tolerance: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description=(
            "Each class's share may deviate this much (relative) from 1/num_classes where a balanced subset "
            "was asked for (num_train / num_validation set)."
        ),
    )


class OcclusionManifestsConfig(AssetConfig):
    """Config of the ``occlusion_manifests`` asset."""

    profile_key = "occlusion_manifests"

    source: Literal["cifar10", "fashion_mnist", "image_folder"] = Field(
        default="cifar10",
        description="Image source: the CIFAR-10 python tarball, Fashion-MNIST idx files, "
        "or a folder with train/ and test/ sub-folders of one folder per class.",
    )
    source_uri: str | None = Field(
        default=None,
        description="URL or local path of the source; unset = the official URL "
        "(CIFAR-10 tarball / Fashion-MNIST directory). Required for image_folder.",
    )
    source_md5: str | None = Field(
        default=None, description="Expected md5 of the CIFAR-10 tarball; unset = the official one for the official URL."
    )
    num_train: int | None = Field(default=None, ge=1, description="Train images (class-balanced, seeded); unset = all.")
    num_validation: int | None = Field(
        default=None,
        ge=1,
        description=("Validation images (class-balanced, seeded) from the source's test split; unset = all."),
    )
    train_box_min: float = Field(default=0.22, description="Smallest train box side, as a fraction of the image side.")
    train_box_max: float = Field(default=0.42, description="Largest train box side, as a fraction of the image side.")
    validation_box_min: float = Field(default=0.28, description="Smallest validation box side fraction.")
    validation_box_max: float = Field(default=0.45, description="Largest validation box side fraction.")
    seed: int = Field(default=7, description="Seeds subset choice and boxes: same config, byte-identical manifests.")
    resize_to: int | None = Field(
        default=None, ge=1, description="image_folder only: resize every image to this square side."
    )
    validation_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description=("image_folder with only train/: the seeded share of each class held out as the validation split."),
    )
    checks: BalanceCheckConfig = step_field(CHECKS_SECTION, default_factory=BalanceCheckConfig)

    def box_bounds(self) -> dict[str, BoxBounds]:
        """Return each split's configured bounds on a box side."""
        return {
            split: BoxBounds(getattr(self, f"{split}_box_min"), getattr(self, f"{split}_box_max"))
            for split in ("train", "validation")
        }

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for split in ("train", "validation"):
            try:
                BoxBounds(getattr(self, f"{split}_box_min"), getattr(self, f"{split}_box_max"))
            except ValueError as err:
                raise ValueError(f"{split}_box_min/{split}_box_max: {err}") from None
        if self.source == "image_folder" and not self.source_uri:
            raise ValueError("source_uri is required when source is 'image_folder'")
        if self.resize_to is not None and self.source != "image_folder":
            raise ValueError("resize_to applies only to source 'image_folder'")
        return self


def _outcome(judged: Judged, judge) -> dg.AssetCheckResult:
    bounds = _config(judged.ref).box_bounds()
    return judged.outcome(lambda root: occlusion_checks.scan(root, bounds), judge)


def _config(ref: ArtifactRef) -> "OcclusionManifestsConfig":
    return OcclusionManifestsConfig(**ref.metadata["config"])


def boxes_within_configured_bounds(judged: Judged) -> dg.AssetCheckResult:
    """Every box's width and height fractions lie within the configured bounds of its split."""
    return _outcome(judged, occlusion_checks.boxes_within_bounds)


def every_class_present_and_balanced(judged: Judged) -> dg.AssetCheckResult:
    """Check that each split holds every class, and is balanced where a balanced subset was asked for.

    Where ``num_train`` / ``num_validation`` is set, each class is within ``checks.balance_tolerance``; otherwise
    the source's own class histogram is reported and an imbalance is only a warning (nothing balanced was promised).
    """
    asked = _config(judged.ref)
    balanced = {"train": asked.num_train is not None, "validation": asked.num_validation is not None}
    return _outcome(
        judged, lambda scanned: occlusion_checks.classes_balanced(scanned, judged.settings.balance_tolerance, balanced)
    )


def counts_match_config(judged: Judged) -> dg.AssetCheckResult:
    """Row counts equal num_train / num_validation (when set) and the artifact's own summary."""
    config = _config(judged.ref)
    expected = {"train": config.num_train, "validation": config.num_validation}
    return _outcome(judged, lambda scanned: occlusion_checks.counts_match(scanned, expected))


def every_image_readable(judged: Judged) -> dg.AssetCheckResult:
    """Every image a manifest row references exists, decodes, and has the size the row states."""
    return _outcome(judged, occlusion_checks.images_readable)


def build_manifests(step: Step) -> Built:
    """Build the ``occlusion_manifests`` artifact in the step's staging folder from the configured image source."""
    config, staging = step.config, step.staging
    source = load_source(
        config.source,
        config.source_uri,
        cache_dir() / "downloads",
        md5=config.source_md5,
        resize_to=config.resize_to,
        validation_fraction=config.validation_fraction,
        seed=config.seed,
        log=step.context.log.info,
    )
    bounds = config.box_bounds()
    summary = write_occlusion_manifests(
        source,
        staging,
        num_train=config.num_train,
        num_validation=config.num_validation,
        train_box=bounds["train"],
        validation_box=bounds["validation"],
        seed=config.seed,
    )
    splits = summary["splits"]
    occlusion_preview(staging).save(staging / "preview.png")
    return Built(
        scan=occlusion_checks.scan(staging, bounds),
        metrics={"num_train": splits["train"]["num_images"], "num_validation": splits["validation"]["num_images"]},
        metadata={
            "dataset": summary["name"],
            "class_names": ", ".join(summary["class_names"]),
            "image_size": f"{splits['train']['width']}x{splits['train']['height']}x{splits['train']['channels']}",
        },
        markdown={"preview": step.run.log_image(staging / "preview.png", "first training images with their boxes")},
    )


occlusion_manifests = memoized_asset(
    "occlusion_manifests",
    description="""Images of a 10-class source, each with one seeded random black rectangle (train 22-42 %,
    validation 28-45 % of each side by default), as ``train.jsonl`` / ``validation.jsonl`` manifests
    (image ref, label, prompt, box in pixels) plus the clean images packed at source resolution.
    Read them for training with ``vlm_assets.data.occlusion_dataset.OcclusionDataset``.""",
    config_type=OcclusionManifestsConfig,
    build=build_manifests,
    checks=(
        boxes_within_configured_bounds,
        every_class_present_and_balanced,
        counts_match_config,
        every_image_readable,
    ),
    code_version="2",
    kinds={"python", "numpy"},
    group_name="data",
)
