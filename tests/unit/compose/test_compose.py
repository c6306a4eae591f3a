"""The compose deployment checked without a docker engine.

The files parse; every project service runs a real ``rollout-bus`` command with flags it accepts
and only ``ROLLOUT_BUS_*`` variables that command reads (typer options' ``envvar`` plus the fields
of the settings classes its CLI module uses); volumes, host ports, Kafka listeners, bootstrap
servers, the Prometheus scrape target and the Grafana provisioning agree with each other. The
small compose model here (interpolation, the override merge) is shared with
tests/integration/test_compose_parity.py.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the compose files (test extras)")

REPO = Path(__file__).resolve().parents[3]
COMPOSE = REPO / "compose"
BASE = COMPOSE / "docker-compose.yml"
CLUSTER = COMPOSE / "docker-compose.cluster.yml"
SECURE = COMPOSE / "docker-compose.secure.yml"
LAYOUTS = {"single": (BASE,), "cluster": (BASE, CLUSTER), "secure": (BASE, SECURE)}
SECRETS = "./secrets/"  # ${ROLLOUT_BUS_SECRETS_DIR:-./secrets}: the secured layout's, never in the repository
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_]\w*)")


# ---------------------------------------------------------------- the compose model


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``${NAME:?err}``, ``$$``."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1) or match.group(4), match.group(2), match.group(3) or ""
        value = env.get(name)
        if op in (":-", "-"):
            return arg if value is None or (op == ":-" and value == "") else value
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise ValueError(f"required variable {name} is unset: {arg}")
        if op in (":+", "+"):
            return arg if value else ""
        return value or ""
    return _VAR.sub(one, text)


def _resolve(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: _resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, env) for v in node]
    return node


def environment(service: dict) -> dict[str, str]:
    """A service's environment as a dict of strings (compose allows a list of K=V too)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.items()}


def _volume_target(entry) -> str:
    return entry["target"] if isinstance(entry, dict) else str(entry).split(":")[1]


def _merge_service(base: dict, over: dict) -> dict:
    """Compose's override rules: mappings merge by key, volumes by target, ports concatenate."""
    merged = dict(base)
    for key, value in over.items():
        if key == "environment":
            merged[key] = {**environment(base), **environment(over)}
        elif key == "volumes":
            by_target = {_volume_target(v): v for v in base.get(key, [])}
            by_target.update({_volume_target(v): v for v in value})
            merged[key] = list(by_target.values())
        elif key in ("ports", "expose"):
            merged[key] = list(base.get(key, [])) + [v for v in value if v not in base.get(key, [])]
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = {**base[key], **value}
        else:
            merged[key] = value
    return merged


def load(*files: Path, env: dict[str, str] | None = None) -> dict:
    """The compose project of ``files`` (later ones override), interpolated with ``env``."""
    project: dict = {"services": {}, "volumes": {}}
    for path in files:
        doc = _resolve(yaml.safe_load(path.read_text()), env or {})
        for name, service in (doc.get("services") or {}).items():
            old = project["services"].get(name)
            project["services"][name] = _merge_service(old, service) if old else service
        project["volumes"].update(doc.get("volumes") or {})
    return project


def project_services(project: dict) -> dict[str, dict]:
    """The services built from the project image (they, and only they, run ``rollout-bus``)."""
    return {n: s for n, s in project["services"].items() if "build" in s}


def command_path(command: list[str]) -> list[str]:
    """``["rollout-bus", "topics", "create", "--x", "1"]`` -> ``["topics", "create"]``."""
    path = []
    for word in command[1:]:
        if word.startswith("-"):
            break
        path.append(word)
    return path


def host_ports(service: dict) -> list[tuple[str, int]]:
    """(host ip, host port) of every port a service publishes on a fixed host port."""
    published = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            if entry.get("published"):
                published.append((entry.get("host_ip", "0.0.0.0"), int(entry["published"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        if len(parts) >= 2:
            published.append((parts[0] if len(parts) == 3 else "0.0.0.0", int(parts[-2])))
    return published


# ---------------------------------------------------------------- what the CLI reads


@cache
def cli_command(path: tuple[str, ...]):
    """The click command of ``rollout-bus <path>``: registered in main, else its own module; None if absent."""
    import typer

    from rollout_bus.cli import main

    node = typer.main.get_command(main.app)
    for word in path:
        node = getattr(node, "commands", {}).get(word)
        if node is None:
            break
    if node is not None:
        return node
    try:
        module = importlib.import_module(f"rollout_bus.cli.{path[0]}")
    except ModuleNotFoundError:
        return None
    if isinstance(getattr(module, "app", None), typer.Typer):
        node = typer.main.get_command(module.app)
        for word in path[1:]:
            node = getattr(node, "commands", {}).get(word)
        return node
    if callable(getattr(module, path[0], None)):
        single = typer.Typer()
        single.command()(getattr(module, path[0]))
        return typer.main.get_command(single)
    return None


def settings_env_vars(module_name: str) -> set[str]:
    """``ROLLOUT_BUS_<FIELD>`` of every settings class a CLI module uses."""
    from pydantic_settings import BaseSettings

    from rollout_bus.config import ENV_PREFIX

    module = importlib.import_module(module_name)
    classes = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, BaseSettings)]
    return {f"{ENV_PREFIX}{field}".upper() for cls in classes for field in cls.model_fields}


def env_vars_read(path: tuple[str, ...]) -> set[str]:
    command = cli_command(path)
    names = set()
    for param in command.params:
        envvar = param.envvar or []
        names.update([envvar] if isinstance(envvar, str) else envvar)
    callback = getattr(command.callback, "__wrapped__", command.callback)
    return names | settings_env_vars(callback.__module__)


def services_in(layout: str) -> list[tuple[str, str]]:
    return [(layout, name) for name in project_services(load(*LAYOUTS[layout]))]


ALL_SERVICES = services_in("single") + services_in("cluster")
COMMANDS = sorted({tuple(command_path(s["command"])) for s in project_services(load(BASE, CLUSTER)).values()})


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("path", [BASE, CLUSTER, COMPOSE / "prometheus/prometheus.yml",
                                  *sorted((COMPOSE / "grafana/provisioning").rglob("*.yml"))], ids=lambda p: p.name)
def test_every_compose_yaml_file_parses_to_a_mapping(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)


@pytest.mark.parametrize("layout,name", ALL_SERVICES)
def test_every_project_service_runs_a_rollout_bus_command(layout, name):
    service = load(*LAYOUTS[layout])["services"][name]
    assert isinstance(service["command"], list) and service["command"][0] == "rollout-bus"
    assert command_path(service["command"]), f"{name} runs bare rollout-bus"


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_service_command_answers_help(path):
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", *path, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"rollout-bus {' '.join(path)} --help failed:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("layout,name", ALL_SERVICES)
def test_every_flag_a_service_passes_is_one_its_command_accepts(layout, name):
    command = load(*LAYOUTS[layout])["services"][name]["command"]
    path = tuple(command_path(command))
    cli = cli_command(path)
    assert cli is not None, f"no command rollout-bus {' '.join(path)}"
    accepted = {opt for param in cli.params for opt in param.opts + param.secondary_opts}
    flags = {word.split("=")[0] for word in command if word.startswith("--")}
    assert flags <= accepted, f"{name}: rollout-bus {' '.join(path)} has no {sorted(flags - accepted)}"


@pytest.mark.parametrize("layout,name", ALL_SERVICES)
def test_every_rollout_bus_variable_a_service_sets_is_read_by_its_command(layout, name):
    service = load(*LAYOUTS[layout])["services"][name]
    path = tuple(command_path(service["command"]))
    assert cli_command(path) is not None, f"no command rollout-bus {' '.join(path)}"
    wanted = {k for k in environment(service) if k.startswith("ROLLOUT_BUS_")}
    assert wanted, f"{name} is configured by no ROLLOUT_BUS_* variable"
    unread = wanted - env_vars_read(path)
    assert not unread, f"{name}: rollout-bus {' '.join(path)} never reads {sorted(unread)}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_named_volume_used_is_declared_and_every_bind_source_exists(layout):
    project = load(*LAYOUTS[layout])
    for name, service in project["services"].items():
        for entry in service.get("volumes", []):
            source = entry.get("source") if isinstance(entry, dict) else str(entry).split(":")[0]
            if source.startswith(SECRETS):
                continue  # made by `rollout-bus kafka secrets` (test_the_secure_layout_mounts_only_made_secrets)
            if source.startswith((".", "/")):
                assert (COMPOSE / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in project["volumes"], f"{name} uses undeclared volume {source}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_two_services_publish_the_same_host_port(layout):
    seen: dict[int, str] = {}
    for name, service in load(*LAYOUTS[layout])["services"].items():
        for _, port in host_ports(service):
            assert port not in seen, f"host port {port} published by {seen.get(port)} and {name}"
            seen[port] = name


def test_every_interpolated_variable_has_a_default_so_up_needs_no_env_file():
    for path in (BASE, CLUSTER, SECURE):
        for match in _VAR.finditer(path.read_text()):
            assert match.group(0) == "$$" or match.group(2) in (":-", "-"), f"{path.name}: {match.group(0)}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_stream_worker_scales_as_one_consumer_group(layout):
    services = load(*LAYOUTS[layout])["services"]
    stream = services["stream"]
    assert "container_name" not in stream and not stream.get("ports"), "replicas would clash"
    app_id = environment(stream)["ROLLOUT_BUS_APP_ID"]
    assert app_id and "$" not in app_id and "{{" not in app_id, "every replica must share one app id"
    assert int(environment(services["topics"])["ROLLOUT_BUS_TURNS_PARTITIONS"]) >= 3, "--scale stream=3 would idle"


def test_the_stages_start_only_after_the_topics_exist_and_topics_runs_once():
    services = load(BASE)["services"]
    assert services["topics"]["restart"] == "no"
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("generator", "stream", "shards", "exporter"):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully", name


def test_the_shard_writer_writes_to_a_named_volume_at_its_out_directory():
    project = load(BASE)
    shards = project["services"]["shards"]
    mounts = {_volume_target(v): str(v).split(":")[0] for v in shards["volumes"]}
    out = environment(shards)["ROLLOUT_BUS_OUT"]
    assert out in mounts and mounts[out] in project["volumes"]


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    found = {}
    for item in value.split(","):
        name, address = item.split("://")
        host, port = address.rsplit(":", 1)
        found[name] = (host, int(port))
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kafka_advertised_listeners_match_the_bootstrap_servers_and_published_ports(layout):
    project = load(*LAYOUTS[layout])
    brokers = {n: s for n, s in project["services"].items()
               if str(s.get("image", "")).startswith("apache/kafka:") and "KAFKA_NODE_ID" in environment(s)}
    advertised = set()
    for name, broker in brokers.items():
        env = environment(broker)
        bound, adverts = _listeners(env["KAFKA_LISTENERS"]), _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
        for listener, (host, port) in adverts.items():
            assert bound[listener][1] == port, f"{name}: {listener} advertised on {port}, bound on {bound[listener]}"
            if listener == env["KAFKA_INTER_BROKER_LISTENER_NAME"] != "INTERNAL":
                continue  # the brokers' own listener (the secured layout's BROKER): no client bootstraps there
            if host == "localhost":
                assert ("127.0.0.1", port) in host_ports(broker), f"{name}: localhost:{port} is not published"
            else:
                assert host in (name, broker.get("hostname")), f"{name} advertises another host {host}"
                advertised.add(f"{host}:{port}")
        voters = dict(v.split("@") for v in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","))
        assert voters[env["KAFKA_NODE_ID"]] == f"{broker.get('hostname', name)}:{bound['CONTROLLER'][1]}"
    for name, service in project_services(project).items():
        servers = environment(service)["ROLLOUT_BUS_BOOTSTRAP_SERVERS"].split(",")
        assert set(servers) == advertised, f"{name} bootstraps from {servers}, brokers advertise {sorted(advertised)}"


def test_the_cluster_has_three_static_voters_replication_three_and_min_isr_two():
    project = load(BASE, CLUSTER)
    brokers = [s for s in project["services"].values() if str(s.get("image", "")).startswith("apache/kafka:")]
    envs = [environment(b) for b in brokers]
    assert len(brokers) == 3 and sorted(e["KAFKA_NODE_ID"] for e in envs) == ["1", "2", "3"]
    assert len({e["KAFKA_CONTROLLER_QUORUM_VOTERS"] for e in envs}) == 1 and len({e["CLUSTER_ID"] for e in envs}) == 1
    for env in envs:
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2" and env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
    for name in ("topics", "stream"):
        assert environment(project["services"][name])["ROLLOUT_BUS_REPLICATION_FACTOR"] == "3", name
    assert len({str(v).split(":")[0] for b in brokers for v in b["volumes"]}) == 3, "one volume per broker"


def test_images_are_pinned_by_tag_and_kafka_is_4_1_1():
    for name, service in load(BASE, CLUSTER)["services"].items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: {image}"
        if "kafka" in name:
            assert image == "apache/kafka:4.1.1"


def test_prometheus_scrapes_the_port_the_exporter_listens_on():
    exporter = load(BASE)["services"]["exporter"]
    command = exporter["command"]
    port = command[command.index("--listen-port") + 1]
    config = yaml.safe_load((COMPOSE / "prometheus/prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "rollout-bus")
    assert [t for c in job["static_configs"] for t in c["targets"]] == [f"exporter:{port}"]
    assert port in [str(p) for p in exporter["expose"]] and f":{port}/" in " ".join(exporter["healthcheck"]["test"])


def test_grafana_provisions_the_datasource_and_a_dashboard_for_the_rollout_metrics():
    grafana = load(BASE)["services"]["grafana"]
    mounts = {_volume_target(v): str(v).split(":")[0] for v in grafana["volumes"]}
    provisioning = COMPOSE / mounts["/etc/grafana/provisioning"]
    source = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    provider = yaml.safe_load((provisioning / "dashboards/rollout-bus.yml").read_text())["providers"][0]
    dashboards = COMPOSE / mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "rollout-bus.json").read_text())
    assert source["url"] == "http://prometheus:9090"
    targets = [t for p in dashboard["panels"] for t in p["targets"]]
    assert {t["datasource"]["uid"] for t in targets} | {p["datasource"]["uid"] for p in dashboard["panels"]} \
        == {source["uid"]}
    exprs = " ".join(t["expr"] for t in targets)
    for metric in [*(f"rollout_episode_response_length_{s}" for s in ("mean", "median", "min", "max")),
                   "rollout_episode_raw_reward", "rollout_batches_total", "rollout_consumer_lag"]:
        assert metric in exprs, metric
    assert "sum by (reason) (increase(rollout_dlq_records_total" in exprs


def test_the_dockerfile_is_slim_pinned_and_runs_as_a_non_root_user():
    text = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-\w+$", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and not users[-1].startswith(("root", "0")), users
    assert "download.pytorch.org/whl/cpu" in text
    # the same locked versions as every machine's venv: the lock, with its hashes, not pyproject.toml's ranges
    assert "COPY requirements.lock" in text and "--require-hashes --no-deps -r requirements.lock" in text
    assert "pip install ." not in text.replace("pip install --no-deps .", "")
    assert "!requirements.lock" in (COMPOSE.parent / ".dockerignore").read_text()


def test_the_readme_lists_every_variable_a_service_sets():
    readme = (COMPOSE / "README.md").read_text()
    for layout, name in ALL_SERVICES:
        for var in environment(load(*LAYOUTS[layout])["services"][name]):
            assert var in readme, f"compose/README.md does not mention {var} ({name})"


def _compose_cli() -> list[str] | None:
    """``docker compose`` where the plugin is installed, else the binary ``make compose-check`` built into
    the cache (``compose/compose-plugin.sh``), which runs on its own; None when neither is here."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    cache = os.environ.get("ROLLOUT_BUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout-bus")
    built = sorted(Path(cache).glob("docker-compose-v*/docker-compose"))
    return [str(built[-1])] if built else None


def test_docker_compose_accepts_both_layouts():
    compose = _compose_cli()
    if compose is None:
        pytest.skip("no `docker compose` here: `make compose-check` builds it from the Go module proxy (minutes)")
    for files in LAYOUTS.values():
        args = [a for f in files for a in ("-f", str(f))]
        done = subprocess.run([*compose, *args, "--profile", "observability", "--profile", "tools",
                               "config", "-q"], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr


def test_the_secure_layout_mounts_only_made_secrets_and_names_no_password():
    from rollout_bus.local_kafka.compose_secrets import ComposeSecrets

    made = ComposeSecrets(COMPOSE / "secrets")
    setup = made.setup
    files = {setup.ca_file, setup.keystore().store, made.kafka_secrets, made.kafka_tls,
             *(setup.password_file(u) for u in setup.users()), *(made.scram_file(u) for u in setup.users())}
    raw = yaml.safe_load(SECURE.read_text())
    sources = [interpolate(entry["file"], {}) for entry in raw["secrets"].values()]
    sources += [interpolate(v, {}).split(":")[0] for service in raw["services"].values()
                for v in service.get("volumes", []) if "SECRETS_DIR" in v]
    assert sources and all((COMPOSE / src).resolve() in {f.resolve() for f in files} for src in sources), sources
    project = load(BASE, SECURE)
    for name, service in project_services(project).items():  # every stage logs in, its password by file
        env = environment(service)
        assert env["ROLLOUT_BUS_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["ROLLOUT_BUS_SASL_PASSWORD_FILE"].startswith("/run/secrets/"), name
        assert not any("PASSWORD" in k and not k.endswith("_FILE") for k in env), name
