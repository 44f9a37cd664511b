"""The docs' reference pages, rendered from the code they describe so that they cannot drift.

Each `render_*` function returns markdown:

- `render_settings()`: every field of every pydantic settings model (`SETTINGS_MODELS`), as its
  environment variable (the model's prefix + the field's name), type, default and docstring;
- `render_metrics()`: every Prometheus metric the services register (`metric_families()`), with
  its type, labels and help;
- `render_policy()`: the fields of a tenant's learning policy (`clora.registry.LearningPolicy`);
- `render_cli()`: every `clora` command, its arguments and options, from the typer app;
- `render_openapi(app)`: a FastAPI app's routes, parameters, bodies and responses, from its
  `.openapi()` document (`openapi_apps()` builds the webhook, control API and Tinker API apps
  without connecting to anything).

The MkDocs hook `docs/hooks.py` calls `render(name)` wherever a page holds the marker
`<!-- generated: NAME -->` (`MARKER`), at every build:

    <!-- generated: settings -->

`python -m clora.infra.docgen settings` prints one reference to stdout.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = re.compile(r"<!--\s*generated:\s*([a-z_-]+)\s*-->")
"""Where a page asks for a generated reference: `<!-- generated: settings -->`."""

SETTINGS_MODELS: tuple[str, ...] = (
    "clora.settings:PlatformSettings",
    "clora.settings:KafkaSettings",
    "clora.storage:StorageSettings",
    "clora.infra.settings:BrokerSettings",
    "clora.infra.settings:RedisSettings",
    "clora.ingest.settings:WebhookSettings",
    "clora.ingest.settings:IngestSettings",
    "clora.infra.settings:ConsoleSettings",
    "clora.infra.settings:SupervisorSettings",
    "clora.learner.settings:LearnerSettings",
    "clora.serving.settings:EngineSettings",
    "clora.serving.settings:GatewaySettings",
    "clora.trainapi.settings:TrainApiSettings",
)
"""Every settings model of the platform, `module:Class`, in the order the page lists them
(tests/infra/test_docgen.py checks that no `BaseSettings` class in the source is missing)."""


def load(path: str) -> Any:
    """The object `module:attribute` names."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


# --- pydantic models -----------------------------------------------------------------------

def attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of `cls` (and of its clora bases), which
    pydantic does not keep unless a model asks it to (`use_attribute_docstrings`)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith(("pydantic", "builtins")) or klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse(inspect.cleandoc(source) if source[:1].isspace() else source)
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def type_name(annotation: Any) -> str:
    """`annotation` as a reader writes it: `int`, `str | None`, `Literal['a', 'b']`, `list[str]`."""
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def default_text(field: FieldInfo) -> str:
    """The field's default as JSON-like text; a default computed at run time says which function
    computes it (`default_learner_id()`) rather than the value on the machine building the docs."""
    if field.default_factory is not None:
        factory = field.default_factory
        if getattr(factory, "__name__", "") != "<lambda>":
            return f"computed: {factory.__name__}()"
        value = factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _one_line(text: str) -> str:
    """A docstring as one markdown paragraph (its line breaks are wrapping, not structure)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


@dataclass(frozen=True)
class SettingDoc:
    """One field of a settings model, as the reference lists it."""

    env: str
    """`CLORA_LEARNER_RANK`"""
    field: str
    type: str
    default: str
    doc: str


def setting_docs(model: type) -> list[SettingDoc]:
    """Every field of a pydantic-settings `model`, with its environment variable."""
    prefix = model.model_config.get("env_prefix", "")
    docs = attribute_docstrings(model)
    return [SettingDoc(env=f"{prefix}{name}".upper(), field=name, type=type_name(f.annotation),
                       default=default_text(f), doc=_one_line(docs.get(name) or f.description or ""))
            for name, f in model.model_fields.items()]


def render_settings(models: tuple[str, ...] = SETTINGS_MODELS) -> str:
    out: list[str] = []
    for path in models:
        model = load(path)
        module = path.partition(":")[0]
        prefix = model.model_config.get("env_prefix", "")
        out.append(f"## `{prefix}*`: {model.__name__}\n")
        out.append(f"`{module}.{model.__name__}`. {inspect.cleandoc(model.__doc__ or '').strip()}\n"
                   if model.__doc__ and not model.__doc__.startswith(model.__name__ + "(")
                   else f"`{module}.{model.__name__}`.\n")
        for s in setting_docs(model):
            out.append(f"- **`{s.env}`** (`{s.type}`, default `{s.default}`)" + (f": {s.doc}" if s.doc else ""))
        out.append("")
    return "\n".join(out)


def render_policy() -> str:
    """The learning policy's fields, as `PATCH /api/tenants/{id}/policy` takes them."""
    from clora.registry import LearningPolicy

    docs = attribute_docstrings(LearningPolicy)
    out = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, f in LearningPolicy.model_fields.items():
        bounds = ", ".join(f"{k} {v}" for m in f.metadata for k, v in _bounds(m))
        meaning = _one_line(docs.get(name, "")) + (f" ({bounds})" if bounds else "")
        out.append(f"| `{name}` | `{type_name(f.annotation)}` | `{default_text(f)}` | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


def _bounds(meta: Any) -> list[tuple[str, Any]]:
    symbols = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "max_length": "length ≤"}
    return [(sym, getattr(meta, key)) for key, sym in symbols.items() if getattr(meta, key, None) is not None]


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell: its pipes escaped outside code spans."""
    parts = text.split("`")
    return "`".join(p.replace("|", "\\|") if i % 2 == 0 else p for i, p in enumerate(parts))


# --- metrics -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetricDoc:
    """One metric as a scrape exposes it."""

    service: str
    """Whose metrics port serves it: `ingest`, `learner`, `gateway`."""
    name: str
    """The exposed name: counters end in `_total` (`clora_dlq_total`)."""
    type: str
    labels: tuple[str, ...]
    help: str


def metric_families() -> list[MetricDoc]:
    """Every metric registered by the ingest path (webhook and workers), the learner and the
    gateway, read from registries built the way each service builds its own."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from clora.ingest import metrics as ingest_metrics
    from clora.learner.metrics import LearnerMetrics
    from clora.serving.metrics import GatewayMetrics

    found: list[MetricDoc] = []
    # the ingest metrics live on the process's default registry, as module globals
    for value in vars(ingest_metrics).values():
        if isinstance(value, MetricWrapperBase):
            found.append(_wrapper_doc("ingest", value))
    learner = CollectorRegistry()
    LearnerMetrics(learner)
    found += _registry_docs("learner", learner)
    gateway = CollectorRegistry()
    GatewayMetrics(gateway).watch(_NoEngine(), _NoLogger())
    found += _registry_docs("gateway", gateway)
    return found


class _NoEngine:
    """An engine with no replicas: its collector then describes its families without values."""

    replicas: list = []


class _NoLogger:
    """An interaction logger that has sent nothing, for the same purpose."""

    sent = spooled = rejected = 0

    def queued(self) -> int:
        return 0

    class spool:  # noqa: N801 - mirrors the logger's attribute
        @staticmethod
        def pending_bytes() -> int:
            return 0


def _exposed(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" and not name.endswith("_total") else name


def _wrapper_doc(service: str, metric) -> MetricDoc:
    # prometheus_client keeps a metric's label names only on the metric itself (no public reader)
    return MetricDoc(service, _exposed(metric._name, metric._type), metric._type, tuple(metric._labelnames),
                     metric._documentation)


def _registry_docs(service: str, registry) -> list[MetricDoc]:
    from prometheus_client.metrics import MetricWrapperBase

    docs = []
    for collector in list(registry._collector_to_names):  # a registry lists its collectors no other way
        if isinstance(collector, MetricWrapperBase):
            docs.append(_wrapper_doc(service, collector))
            continue
        for family in collector.collect():
            docs.append(MetricDoc(service, _exposed(family.name, family.type), family.type,
                                  tuple(getattr(family, "_labelnames", ())), family.documentation))
    return docs


def render_metrics() -> str:
    ports = {"ingest": "the webhook's `/metrics` and each ingest worker's metrics port (`CLORA_INGEST_METRICS_PORT`)",
             "learner": "the learner's metrics port (`CLORA_LEARNER_METRICS_PORT`)",
             "gateway": "the gateway's metrics port (`CLORA_GATEWAY_METRICS_PORT`)"}
    out: list[str] = []
    families = metric_families()
    for service in ("ingest", "learner", "gateway"):
        out.append(f"## {service.capitalize()}\n\nServed on {ports[service]}.\n")
        out.append("| metric | type | labels | help |")
        out.append("|---|---|---|---|")
        for m in sorted((m for m in families if m.service == service), key=lambda m: m.name):
            labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
            out.append(f"| `{m.name}` | {m.type} | {labels} | {_cell(m.help)} |")
        out.append("")
    return "\n".join(out)


# --- OpenAPI -------------------------------------------------------------------------------

def openapi_apps() -> dict[str, Callable[[], Any]]:
    """Builders of each documented FastAPI app, wired to clients that never connect (an app's
    OpenAPI document needs its routes, not its services)."""
    import redis.asyncio as aredis

    def webhook():
        from clora.ingest.settings import WebhookSettings
        from clora.ingest.webhook import create_app

        return create_app(WebhookSettings(), None, None, aredis.Redis())

    def control():
        from clora.infra.control import create_control_app

        return create_control_app(None, None, "docs")

    def trainapi():
        from clora.trainapi.app import create_app
        from clora.trainapi.settings import TrainApiSettings

        return create_app(TrainApiSettings(), None, aredis.Redis())

    return {"webhook": webhook, "control": control, "trainapi": trainapi}


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def schema_text(schema: dict | None) -> str:
    """A JSON schema as a short type: `FeedbackIn`, `array of FeedbackIn`, `string | null`."""
    if not schema:
        return "any"
    if "$ref" in schema:
        return f"[{_ref_name(schema['$ref'])}](#{_ref_name(schema['$ref']).lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " | ".join(schema_text(s) for s in schema[key])
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    kind = schema.get("type", "object")
    if kind == "array":
        return f"array of {schema_text(schema.get('items'))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {schema_text(schema['additionalProperties'])}"
    return kind


def render_openapi(app) -> str:
    """A page's worth of `app`'s routes and schemas."""
    spec = app.openapi()
    out = [f"{spec['info'].get('description', '')}\n" if spec["info"].get("description") else ""]
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            out.append(f"## `{method.upper()} {path}`\n")
            summary = op.get("description") or op.get("summary") or ""
            if summary:
                out.append(inspect.cleandoc(summary) + "\n")
            params = op.get("parameters", [])
            if params:
                out.append("| parameter | in | type | required | description |")
                out.append("|---|---|---|---|---|")
                for p in params:
                    out.append(f"| `{p['name']}` | {p['in']} | {_cell(schema_text(p.get('schema')))} | "
                               f"{'yes' if p.get('required') else 'no'} | {_cell(_one_line(p.get('description', '')))} |")
                out.append("")
            body = op.get("requestBody")
            if body:
                for ctype, content in body.get("content", {}).items():
                    out.append(f"**Body** (`{ctype}`{', required' if body.get('required') else ''}): "
                               f"{schema_text(content.get('schema'))}\n")
            responses = op.get("responses", {})
            if responses:
                out.append("| status | meaning | body |")
                out.append("|---|---|---|")
                for status, r in responses.items():
                    schema = next(iter(r.get("content", {}).values()), {}).get("schema")
                    out.append(f"| {status} | {_cell(_one_line(r.get('description', '')))} | "
                               f"{_cell(schema_text(schema)) if schema else '—'} |")
                out.append("")
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        out.append("## Schemas\n")
    for name, schema in schemas.items():
        out.append(f"### {name}\n")
        if schema.get("description"):
            out.append(_one_line(schema["description"]) + "\n")
        props = schema.get("properties", {})
        if props:
            required = set(schema.get("required", []))
            out.append("| field | type | required | description |")
            out.append("|---|---|---|---|")
            for field, s in props.items():
                out.append(f"| `{field}` | {_cell(schema_text(s))} | {'yes' if field in required else 'no'} | "
                           f"{_cell(_one_line(s.get('description', '')))} |")
            out.append("")
        elif "enum" in schema:
            out.append(f"One of {schema_text(schema)}.\n")
    return "\n".join(out)


# --- the CLI --------------------------------------------------------------------------------

def render_cli() -> str:
    """Every `clora` command with its arguments, options and help, from the typer app itself."""
    import typer

    from clora.infra.cli import app

    root = typer.main.get_command(app)
    out: list[str] = []

    def walk(command, path: list[str]) -> None:  # typer's own (vendored) click commands and groups
        if hasattr(command, "commands"):
            for name in sorted(command.commands):
                walk(command.commands[name], [*path, name])
            return
        ctx = command.context_class(command, info_name=" ".join(path))
        out.append(f"### `{' '.join(path)}`\n")
        out.append(f"`{command.get_usage(ctx).removeprefix('Usage: ')}`\n")
        if command.help:
            out.append(inspect.cleandoc(command.help).split("\n\n")[0] + "\n")
        rows = []
        for param in command.params:
            record = param.get_help_record(ctx)
            if record is None and param.param_type_name == "argument":
                record = (param.human_readable_name, "")
            if record is not None:
                rows.append(f"| `{record[0]}` | {_cell(_one_line(record[1]))} |")
        if rows:
            out.extend(["| argument or option | meaning |", "|---|---|", *rows, ""])

    walk(root, ["clora"])
    return "\n".join(out)


# --- the hook's entry point ----------------------------------------------------------------

def render(name: str) -> str:
    """The reference `<!-- generated: NAME -->` asks for."""
    if name == "settings":
        return render_settings()
    if name == "metrics":
        return render_metrics()
    if name == "policy":
        return render_policy()
    if name == "cli":
        return render_cli()
    if name.startswith("openapi-"):
        apps = openapi_apps()
        which = name.removeprefix("openapi-")
        if which not in apps:
            raise KeyError(f"no OpenAPI app {which!r} to document (known: {', '.join(apps)})")
        return render_openapi(apps[which]())
    raise KeyError(f"no generated reference {name!r} (known: settings, metrics, policy, cli, "
                   f"{', '.join('openapi-' + a for a in openapi_apps())})")


def expand(markdown: str) -> str:
    """`markdown` with every `<!-- generated: NAME -->` marker replaced by its reference."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)


if __name__ == "__main__":
    print(render(sys.argv[1] if len(sys.argv) > 1 else "settings"))
