"""deploy/ kept in step with the code: every Kubernetes manifest parses, its core objects validate
against the Kubernetes API schemas (offline, those bundled with kubernetes-validate), the
LeaderWorkerSet (a custom resource, which those schemas lack) has the fields of its API and pod
templates that validate as core pod templates, and every `m3serve` command line in the manifests
and in the container recipe parses with m3serve's own parser and builds a valid configuration,
so that a renamed flag or a refused value fails here. The recipe itself is not built here (no
container runtime or registry is reachable)."""
import argparse
import json
import os
import re
import shlex
from pathlib import Path

import pytest

if os.environ.get("M3SERVE_REQUIRE_TEST_DEPS") == "1":      # set by .ci/run: run or fail
    import kubernetes_validate
    import yaml
else:
    yaml = pytest.importorskip("yaml")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

from m3serve.cli import build_parser  # noqa: E402
from m3serve.engine_args import build_engine_config, engine_kwargs  # noqa: E402
from m3serve.serving.server_args import server_config  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.33"     # the oldest release the manifests are checked against

# What the LeaderWorkerSet controller sets in every container of a group (kubernetes-sigs/lws
# API v1), as a worker pod of a 2-pod group sees it; and its API's fields and allowed values.
LWS_ENV = {"LWS_LEADER_ADDRESS": "m3serve-2node-0.m3serve-2node", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
LWS_SPEC_FIELDS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE_FIELDS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"}
LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}
LWS_RESTART_POLICIES = {"RecreateGroupOnPodRestart", "None", "Default"}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_documents() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in MANIFESTS for d in documents(p)]


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(name, pod template spec) of each pod template in a workload object."""
    if doc["kind"] == "Deployment":
        return [(doc["metadata"]["name"], doc["spec"]["template"])]
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [(f"{doc['metadata']['name']}/{k}", t[k]) for k in ("leaderTemplate", "workerTemplate") if k in t]
    return []


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion of a container's args; a name it cannot expand fails."""
    def one(m):
        assert m.group(1) in env, f"$({m.group(1)}) is defined nowhere in the container's environment"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def container_env(container: dict, kind: str) -> dict[str, str]:
    """Each variable the container defines, with its value (secrets and fields: a stand-in)."""
    env = dict(LWS_ENV) if kind == "LeaderWorkerSet" else {}
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", f"<{var['name']}>")
    return env


def m3serve_commands() -> list[tuple[str, dict, dict, list[str]]]:
    """(where, pod spec, container, argv after `m3serve`) of every m3serve container."""
    out = []
    for name, doc in all_documents():
        for where, template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                command = c.get("command", [])
                if command[:1] == ["m3serve"]:
                    env = container_env(c, doc["kind"])
                    argv = [expand(str(a), env) for a in command[1:] + c.get("args", [])]
                    out.append((f"{name}:{where}", template["spec"], c, argv))
    return out


def _subcommand_options(argv: list[str]) -> set[str]:
    parser = build_parser()
    for word in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return {o for a in parser._actions for o in a.option_strings}


def parse(argv: list[str]):
    """argv parsed as `m3serve` parses it, with the configuration it builds (errors raise). Flags
    must be spelt out: argparse would take a prefix of a renamed flag for the new one."""
    if "--help" in argv:
        argv = [a for a in argv if a != "--help"]
    options = _subcommand_options(argv)
    for word in argv:
        if word == "--":
            break
        if word.startswith("--"):
            assert word.split("=")[0] in options, f"{word}: not a flag of `m3serve {argv[0]}`"
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        if args.model_tag is not None:
            args.model = args.model_tag
        return args, build_engine_config(**engine_kwargs(args)), server_config(args)
    if args.command == "route":
        from m3serve.route import router_command
        return args, router_command(args), None
    return args, None, None


def test_there_are_manifests_for_one_node_two_nodes_and_pd():
    names = {p.name for p in MANIFESTS}
    assert {"one-node-tp8.yaml", "two-nodes-lws.yaml", "pd.yaml", "model-cache.yaml"} <= names
    for _, doc in all_documents():
        assert {"apiVersion", "kind", "metadata"} <= set(doc) and doc["metadata"].get("name")


@pytest.mark.parametrize("name,doc", [(n, d) for n, d in all_documents() if d["kind"] != "LeaderWorkerSet"],
                         ids=lambda v: v if isinstance(v, str) else v["metadata"]["name"])
def test_core_objects_validate_against_the_kubernetes_schemas(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelt_field():
    doc = next(d for _, d in all_documents() if d["kind"] == "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGte"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_leaderworkerset_has_its_api_fields_and_valid_pod_templates():
    sets = [d for _, d in all_documents() if d["kind"] == "LeaderWorkerSet"]
    assert sets
    for doc in sets:
        assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}
        spec = doc["spec"]
        assert set(spec) <= LWS_SPEC_FIELDS and spec.get("startupPolicy", "LeaderCreated") in LWS_STARTUP_POLICIES
        # the leader is ready only once every rank, the workers' included, has loaded
        assert spec.get("startupPolicy") == "LeaderCreated"
        template = spec["leaderWorkerTemplate"]
        assert set(template) <= LWS_TEMPLATE_FIELDS and "workerTemplate" in template
        assert template.get("restartPolicy", "RecreateGroupOnPodRestart") in LWS_RESTART_POLICIES
        assert isinstance(template["size"], int) and template["size"] >= 1
        for key in ("leaderTemplate", "workerTemplate"):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lws-{key.lower()}"},
                       "template": template[key]}
            kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("where,pod,container,argv", m3serve_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_m3serve_command_line_parses_and_configures(where, pod, container, argv):
    parse(argv)


def _serve_pods():
    for where, pod, container, argv in m3serve_commands():
        args, engine, server = parse(argv)
        if args.command == "serve":
            yield where, pod, container, engine, server


def test_serving_pods_probe_drain_and_hold_what_the_command_line_asks():
    checked = 0
    for where, pod, container, engine, server in _serve_pods():
        p = engine.parallel
        gpus = p.world_size // p.nnodes
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus, where
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus, where
        shm = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
        assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in container["volumeMounts"]), where
        assert any(m["mountPath"] == "/models" for m in container["volumeMounts"]), where
        if p.node_rank > 0:
            continue                                    # no HTTP on the other nodes
        checked += 1
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports["http"] == server.port and server.host == "0.0.0.0", where
        for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
            get = container[probe]["httpGet"]
            assert get["path"] == path and ports.get(get["port"], get["port"]) == server.port, (where, probe)
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= server.engine_ready_timeout_s, where
        pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] > pause + server.shutdown_timeout_s, where
    assert checked >= 4        # one node, the two-node leader, prefill, decode


def test_the_nodes_of_one_engine_run_the_same_engine():
    groups: dict[str, list] = {}
    for where, pod, container, engine, server in _serve_pods():
        if engine.parallel.nnodes > 1:
            groups.setdefault(where.split(":")[0], []).append(engine)
    assert groups
    sizes = {d["metadata"]["name"]: d["spec"]["leaderWorkerTemplate"]["size"]
             for _, d in all_documents() if d["kind"] == "LeaderWorkerSet"}
    for engines in groups.values():
        assert sorted(e.parallel.node_rank for e in engines) == [0, 1]
        assert {e.parallel.nnodes for e in engines} == set(sizes.values()) == {2}
        a, b = (dict(vars(e.parallel), node_rank=0) for e in engines)
        assert a == b and engines[0].model == engines[1].model and engines[0].cache == engines[1].cache


def test_the_pd_router_fronts_a_producer_and_a_consumer_service():
    docs = documents(DEPLOY / "kubernetes" / "pd.yaml")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    roles = {}
    for where, pod, container, engine, server in _serve_pods():
        if where.startswith("pd.yaml"):
            assert engine.kv_transfer.kv_connector == "NixlConnector" and server.api_key
            env = {e["name"]: e for e in container["env"]}
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            roles[where.split(":")[1]] = engine.kv_transfer.kv_role
    assert sorted(roles.values()) == ["kv_consumer", "kv_producer"]
    routes = [(argv, c) for where, _, c, argv in m3serve_commands() if argv[0] == "route"]
    assert len(routes) == 1
    (argv, container), = routes
    args, (router_argv, router_env), _ = parse(argv)
    assert "--vllm-pd-disaggregation" in router_argv and router_env.get("OPENAI_API_KEY")
    for urls, role in ((args.prefill, "kv_producer"), (args.decode, "kv_consumer")):
        for url in urls:
            host, port = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url).groups()
            service = services[host]
            assert any(p["port"] == int(port) for p in service["spec"]["ports"]), url
            selected = [name for name in roles if name == host]
            assert selected and roles[selected[0]] == role, url


def dockerfile_commands() -> list[list[str]]:
    """argv after `m3serve` of each m3serve command in deploy/Dockerfile: in RUN lines (shell
    form) and ENTRYPOINT + CMD (exec form)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    instructions = [line.strip().split(None, 1) for line in text.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    out, entrypoint, cmd = [], None, None
    for word, rest in instructions:
        word = word.upper()
        if word == "RUN":
            for part in re.split(r"&&|\|\||;|\|", rest):
                tokens = shlex.split(part.split(">")[0])
                if tokens[:1] == ["m3serve"]:
                    out.append(tokens[1:])
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif word == "CMD":
            cmd = json.loads(rest)
    assert entrypoint == ["m3serve"], entrypoint
    return out + [cmd]


@pytest.mark.parametrize("argv", dockerfile_commands(), ids=" ".join)
def test_the_container_recipe_command_lines_parse(argv):
    parse(argv)


def test_a_renamed_flag_or_a_bad_value_fails_the_check():
    with pytest.raises(AssertionError, match="--tp-size: not a flag"):
        parse(["serve", "MiniMaxAI/MiniMax-M3", "--tp-size", "8"])
    with pytest.raises(SystemExit):
        parse(["serve", "MiniMaxAI/MiniMax-M3", "-tp", "eight"])
    with pytest.raises(AssertionError, match="--tensor-parallel: not a flag"):
        parse(["serve", "MiniMaxAI/MiniMax-M3", "--tensor-parallel", "8"])      # a prefix argparse accepts
    with pytest.raises(ValueError):
        parse(["serve", "-tp", "8", "--nnodes", "2", "--node-rank", "2"])


def readme_commands() -> list[list[str]]:
    """argv after `m3serve` of each command line in the README's code blocks."""
    lines, out = (DEPLOY.parent / "README.md").read_text().splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        if line.startswith("m3serve ") and (lines[i].startswith("    ") or lines[i - 1].strip().startswith("m3serve")):
            out.append(shlex.split(line, comments=True)[1:])
        i += 1
    return out


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_the_readme_command_lines_parse(argv):
    parse(argv)


def test_the_readme_shows_the_serve_plan_and_generate_commands():
    commands = {argv[0] for argv in readme_commands()}
    assert {"serve", "plan", "generate"} <= commands
    assert all(argv[1:2] != [] for argv in readme_commands() if argv[0] == "plan")   # plan needs its MODEL


def test_the_one_node_manifest_runs_the_readme_command():
    readme = next(a for a in readme_commands() if a[:2] == ["serve", "MiniMaxAI/MiniMax-M3"])
    manifest = next(argv for where, _, _, argv in m3serve_commands() if where.startswith("one-node-tp8.yaml"))
    (_, engine_a, server_a), (_, engine_b, server_b) = parse(readme), parse(manifest)
    assert engine_a == engine_b
    for name in ("port", "served_model_name", "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice"):
        assert getattr(server_a, name) == getattr(server_b, name), name
