"""Run profiles as config defaults, so every way of launching an asset uses the active profile.

``seed`` = the defaults written in the config classes (official CIFAR-10, wikitext-103, gpt2 from the
hub, full-size training). ``demo`` (``vlm_assets/profiles/demo.yaml``) = the real offline data of
``scripts/fetch-offline-data.sh`` at small scale; its values replace those defaults when the code
location loads with ``VLM_ASSETS_PROFILE=demo`` (the default). A profile of one's own is a YAML file
of the same shape (``VLM_ASSETS_PROFILE=/path/to/profile.yaml``). Because they are the config classes'
defaults, `main_job`, the UI's "Materialize" buttons, `dagster asset materialize` and the schedule all
run the same thing, and a value given in run config still wins. A profile is data keyed by asset name
(``<asset>.checks`` for an asset's checks section); each config class claims its key (``profile_key``),
and a key no class claims or a value a field rejects fails the load, naming it.
"""

import enum
import io
import string
from pathlib import Path
from typing import Any, ClassVar

import dagster as dg
import pydantic
import yaml

from vlm_assets.defs.platform.environment import profile
from vlm_assets.paths import offline_data_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples"  # package data (pyproject.toml)
PROFILE_DIR = Path(__file__).resolve().parents[2] / "profiles"  # package data too


def profile_defaults(name: str) -> dict[str, dict[str, Any]]:
    """Return the field defaults of profile ``name`` by asset name (``<asset>.checks`` for its checks section).

    None for ``seed``, ``vlm_assets/profiles/demo.yaml`` for ``demo``, else the YAML file ``name`` (same shape).
    """
    if name == "seed":
        return {}
    path = PROFILE_DIR / f"{name}.yaml" if name == "demo" else Path(name)
    try:
        text = string.Template(path.read_text()).substitute(offline_data=offline_data_dir(), examples=EXAMPLES)
        stream = io.StringIO(text)
        stream.name = str(path)  # YAML's errors name the stream: the file, line and column
        values = yaml.safe_load(stream)
    except KeyError as err:
        raise ValueError(f"profile {path}: ${{{err.args[0]}}} is neither ${{offline_data}} nor ${{examples}}") from None
    except UnicodeDecodeError as err:  # a ValueError too, but not the template's
        raise ValueError(f"profile {path} is not UTF-8 text: {err}") from None
    except ValueError as err:  # a lone $
        raise ValueError(f"profile {path}: {err} (write $$ for a $)") from None
    except yaml.YAMLError as err:
        raise ValueError(f"profile {path} is not valid YAML: {err}") from None
    if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
        raise ValueError(f"profile {path}: expected a mapping of asset name -> field values")
    return values


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
    """A config mixin: the active profile's values under ``profile_key`` become the field defaults.

    Mixed into asset and check configs.
    """

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
    """Check that every key of the active profile names a config that claims it.

    A misspelt or renamed asset fails the load instead of silently dropping its profile.
    """
    if unclaimed := sorted(set(profile_defaults(profile())) - _CLAIMED):
        claimed = ", ".join(sorted(_CLAIMED))
        raise ValueError(f"profile {profile()!r}: no asset config claims {', '.join(unclaimed)} (claimed: {claimed})")
