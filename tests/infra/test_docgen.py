"""The generated references (clora.infra.docgen) against what they describe: every settings field
and its environment variable, every registered metric, every OpenAPI route and schema."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from clora.infra import docgen

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "infra", "ingest", "learner", "serving", "trainapi", "agents", "kernels")


def settings_classes_in_source() -> set[str]:
    """`Class` names of every class the platform's source declares as a `BaseSettings`."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        getattr(b, "id", getattr(b, "attr", None)) == "BaseSettings" for b in node.bases):
                    found.add(node.name)
    return found


def test_every_settings_model_in_the_source_is_documented():
    listed = {path.partition(":")[2] for path in docgen.SETTINGS_MODELS}
    assert settings_classes_in_source() - listed == set()
    for path in docgen.SETTINGS_MODELS:
        assert issubclass(docgen.load(path), BaseSettings), path


def test_every_settings_field_appears_with_its_environment_variable_and_docstring():
    page = docgen.render_settings()
    for path in docgen.SETTINGS_MODELS:
        model = docgen.load(path)
        prefix = model.model_config["env_prefix"]
        docs = docgen.attribute_docstrings(model)
        for name in model.model_fields:
            env = f"{prefix}{name}".upper()
            line = next((ln for ln in page.splitlines() if ln.startswith(f"- **`{env}`**")), None)
            assert line is not None, f"{env} ({path}) is missing from the settings reference"
            if docs.get(name):  # the docstring's first words follow the variable
                assert " ".join(docs[name].split()[:4]) in line, (env, line)


def test_a_settings_default_is_the_models_own():
    page = docgen.render_settings()
    assert "- **`CLORA_LEARNER_RANK`** (`int`, default `8`)" in page
    assert "- **`CLORA_WEBHOOK_PORT`** (`int`, default `8400`)" in page
    # a default computed where the learner runs is named, not the docs machine's value
    assert "- **`CLORA_LEARNER_INSTANCE_ID`** (`str`, default `computed: default_learner_id()`)" in page


def test_attribute_docstrings_reads_the_string_under_each_field():
    from clora.learner.settings import LearnerSettings

    docs = docgen.attribute_docstrings(LearnerSettings)
    assert docs["rank"].startswith("LoRA rank for every tenant")
    assert "alpha" not in docs or docs["alpha"]  # a field without a docstring is simply absent


def test_every_registered_metric_appears_once_with_its_labels():
    from prometheus_client import REGISTRY, CollectorRegistry

    from clora.ingest import metrics as ingest_metrics  # noqa: F401 - registers on REGISTRY
    from clora.learner.metrics import LearnerMetrics

    page = docgen.render_metrics()
    families = docgen.metric_families()
    names = [m.name for m in families]
    assert len(names) == len(set(names)), "a metric is listed twice"
    for m in families:
        assert f"| `{m.name}` | {m.type} |" in page
    # against the registries themselves, as a scrape would name them
    learner = CollectorRegistry()
    LearnerMetrics(learner)
    scraped = {s.name for fam in learner.collect() for s in fam.samples} | {
        fam.name + ("_total" if fam.type == "counter" else "") for fam in learner.collect()}
    for name in ("clora_learner_steps_total", "clora_learner_reward_rollbacks_total", "clora_learner_loss"):
        assert name in scraped and name in names
    ingest_names = {fam.name + ("_total" if fam.type == "counter" else "") for fam in REGISTRY.collect()
                    if fam.name.startswith(("clora_ingest", "clora_dlq", "clora_webhook", "clora_buffer",
                                            "clora_consumer", "clora_feedback_untrained"))}
    assert ingest_names and ingest_names <= set(names)
    assert {"clora_gateway_requests_total", "clora_feedback_to_served_seconds", "clora_engine_replica_healthy",
            "clora_gateway_interactions_rejected_total"} <= set(names)
    row = next(ln for ln in page.splitlines() if ln.startswith("| `clora_gateway_requests_total`"))
    assert "`tenant`, `kind`, `status`" in row


@pytest.mark.parametrize("which", ["webhook", "control", "trainapi"])
def test_every_openapi_path_and_schema_appears(which):
    app = docgen.openapi_apps()[which]()
    spec = app.openapi()
    page = docgen.render_openapi(app)
    for path, operations in spec["paths"].items():
        for method in operations:
            assert f"## `{method.upper()} {path}`" in page
    for name in spec.get("components", {}).get("schemas", {}):
        assert f"### {name}\n" in page


def test_markers_expand_and_an_unknown_one_is_refused_by_name():
    assert "CLORA_LEARNER_RANK" in docgen.expand("x\n<!-- generated: settings -->\ny")
    assert "| `algorithm` |" in docgen.expand("<!-- generated: policy -->")
    with pytest.raises(KeyError, match="settngs"):
        docgen.expand("<!-- generated: settngs -->")


def test_a_pipe_inside_a_table_cell_is_escaped_outside_code_spans():
    assert docgen._cell("a | b `c | d`") == "a \\| b `c | d`"
    assert docgen.type_name(int | None) == "int | None"


def test_every_cli_command_appears_with_its_options():
    import typer

    from clora.infra.cli import app

    page = docgen.render_cli()

    def leaves(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from leaves(sub, [*path, name])
        else:
            yield " ".join(path), command

    commands = dict(leaves(typer.main.get_command(app), ["clora"]))
    assert "clora tenant create" in commands
    for name, command in commands.items():
        assert f"### `{name}`" in page
        section = page.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                assert param.opts[0] in section, (name, param.opts)
