"""The configuration and job spec references (docs/configuration.md, docs/job-spec.md), generated from the models.

Why generated: the pydantic models are the one source of truth for names, types, defaults and
descriptions; a hand-written table drifts. ``tests/test_config_doc.py`` fails when a committed
file differs from what this renders, so the doc changes in the same commit as the setting.

    python -m slime_server.utils.config_doc > docs/configuration.md
    python -m slime_server.utils.config_doc --jobs > docs/job-spec.md
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from slime_server.config import ServerSettings
from slime_server.jobs.spec import JobSpec, LossConfig

HEADER = """# Configuration reference

Generated from the settings models by `python -m slime_server.utils.config_doc` (do not edit by hand).

## Server settings (`slime-server serve`, `engines`, `demo`)

Precedence, highest first: command-line flags > `SLIME_*` environment variables (`__` nests:
`SLIME_ENGINE__NUM_ENGINES=2`) > the YAML file given with `--config` > defaults. A YAML file has one
mapping per section, e.g. `engine: {num_engines: 2}`. Unknown keys are errors.
"""

JOB_HEADER = """# Job spec reference

Generated from `slime_server/jobs/spec.py` by `python -m slime_server.utils.config_doc --jobs` (do not edit by
hand). It is the JSON body of `POST /jobs` and the YAML file of `slime-server train FILE.yaml` (and
`slime-server serve --online`'s live job). Nested objects are listed as their own tables; unknown keys are errors.
"""

LOSS_HEADER = """The `loss` object overrides these fields of the trainer's loss (unknown keys are errors at submit):
"""


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``X``, ``X | None``, ``Optional[X]`` or ``list[X]``, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        return _model_of(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(see table)"
    return f"`{json.dumps(value, default=str)}`"


def _describe(field: FieldInfo) -> str:
    text = " ".join((field.description or "").split()).replace("``", "`").replace("|", "\\|")
    bounds = [f"{name} {getattr(m, attr)}" for m in field.metadata
              for name, attr in ((">", "gt"), (">=", "ge"), ("<", "lt"), ("<=", "le")) if hasattr(m, attr)]
    return "; ".join(x for x in (text, ", ".join(bounds)) if x)


def model_tables(model: type[BaseModel], path: str, env_prefix: str | None = None) -> list[str]:
    """One Markdown table for ``model`` and, after it, one for each nested model field."""
    doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "`")
    cols = "| key | type | default | env | description |" if env_prefix else "| key | type | default | description |"
    out = [f"### `{path}`", "", doc, "", cols, "|" + "---|" * (5 if env_prefix else 4)]
    nested: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        sub_path = f"{path}.{name}" + ("[]" if typing.get_origin(field.annotation) is list else "")
        if sub is not None:
            nested.append((sub, sub_path))
        row = [f"`{name}`", _type_name(field.annotation) if sub is None else f"{sub.__name__} (`{sub_path}`)",
               _default(field)]
        if env_prefix:
            row.append(f"`{env_prefix}{name.upper()}`")
        row.append(_describe(field))
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    for sub, sub_path in nested:
        prefix = f"{env_prefix}{sub_path.rsplit('.', 1)[1].removesuffix('[]').upper()}__" if env_prefix else None
        out += model_tables(sub, sub_path, prefix)
    return out


def render() -> str:
    """docs/configuration.md: every server setting."""
    lines = [HEADER]
    for name, field in ServerSettings.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            lines += model_tables(sub, name, f"SLIME_{name.upper()}__")
    lines.append("The job spec (`POST /jobs`) has its own reference: [Job spec](job-spec.md).")
    return "\n".join(lines).rstrip() + "\n"


def render_jobs() -> str:
    """docs/job-spec.md: the job spec, and the loss config its ``loss`` object overrides."""
    lines = [JOB_HEADER, *model_tables(JobSpec, "job"), LOSS_HEADER, *model_tables(LossConfig, "job.loss")]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_jobs() if "--jobs" in sys.argv[1:] else render(), end="")
