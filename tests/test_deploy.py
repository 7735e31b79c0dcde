"""The cluster recipes under deploy/ hold together. The Slurm recipe also runs on a real Slurm
(tests/test_slurm.py); here every layout is rendered, and what has no engine here (Kubernetes,
an image builder) is validated and parsed:

- the sbatch script passes ``bash -n`` and, in its dry run, prints commands the real CLI accepts
  (option names from ``rlvla3 broker|worker|watch --help``, values parsed by its click
  commands), with a consistent layout (broker first on the first node, one trainer group as
  large as the broker is told, no two workers sharing an index, GPUs only where there are some);
- the Kubernetes manifests pass the Kubernetes API's own schema (kubernetes-validate, offline,
  strict) and agree on kinds, labels, selectors, ports, volumes, Secrets and the trainer
  group's size; their container commands are rendered (``$(VAR)`` from the pod's env) and
  parsed by the same CLI;
- each simulator family's Dockerfile uses valid instructions, shell that ``sh -n`` accepts,
  sources that exist, pip extras that pyproject.toml defines, and the torch pin of the set-up.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

from rlvla3.app.cli import main as cli
from rlvla3.config import load
from rlvla3.scale_config import parse_gpus

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SBATCH = DEPLOY / "slurm" / "rlvla3.sbatch"
K8S = DEPLOY / "k8s"
FAMILIES = {"metaworld": "metaworld", "libero": "libero", "maniskill": "maniskill", "robocasa": None,
            "gymnasium": "gymnasium-mujoco"}
"""Simulator family -> the pyproject extra its image installs (RoboCasa has none: not on the index)."""
ROLES = ("simulator", "generator", "trainer")
KEYS_OPTION = "--keys"
"""How the recipes pass the keys dir that ``rlvla3 keys DIR`` writes (issue 10, item 2)."""


# ---------------------------------------------------------------------------------------------
# The real CLI
# ---------------------------------------------------------------------------------------------


@cache
def help_options(command: str) -> frozenset[str]:
    """Option names listed by ``rlvla3 COMMAND --help``, from the entry point itself."""
    out = subprocess.run([sys.executable, "-m", "rlvla3", command, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return frozenset(re.findall(r"^\s+(--[a-z][\w-]*)", out, re.M))


def keys_option_pending() -> bool:
    """True while the CLI has no key option at all (CURVE keys land on another branch)."""
    return not any("key" in opt for cmd in ("broker", "worker") for opt in help_options(cmd))


def check_cli(argv: list[str]) -> dict[str, Any]:
    """``argv`` (after ``rlvla3``) names only real options, and the command parses them; returns
    the parsed parameters."""
    command, rest = argv[0], list(argv[1:])
    assert command in ("broker", "worker", "watch"), argv
    if KEYS_OPTION in rest and keys_option_pending():
        i = rest.index(KEYS_OPTION)
        del rest[i:i + 2]  # the one option allowed before it exists: see test_keys_option_is_the_clis
    for tok in rest:
        if tok.startswith("--"):
            assert tok.split("=", 1)[0] in help_options(command), f"rlvla3 {command} has no option {tok}"
    ctx = cli.commands[command].make_context(command, rest)
    return ctx.params


def test_keys_option_is_the_clis() -> None:
    if keys_option_pending():
        pytest.skip("rlvla3 has no key option yet (issue 10 item 2): the recipes pass the keys dir as --keys")
    for command in ("broker", "worker"):
        assert KEYS_OPTION in help_options(command), (
            f"rlvla3 {command} names its keys dir option otherwise: update deploy/ and KEYS_OPTION")


# ---------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------


SRUN_OPTIONS = {"overlap", "nodes", "ntasks", "nodelist", "gres", "output", "job-name", "cpus-per-task", "open-mode"}
"""The srun(1) long options the script may use (tests/test_slurm.py runs them on a real Slurm)."""


def render_sbatch(tmp: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH)], cwd=tmp, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp), "RLVLA3_DRY_RUN": "1", "VENV": "/venv",
                               **env})


def watch_line(stdout: str) -> list[str]:
    """The ``rlvla3 watch`` argv the dry run prints first (it runs on the batch node, no srun)."""
    tokens = shlex.split(stdout.splitlines()[0])
    assert tokens[0] == "/venv/bin/rlvla3" and tokens[-2:] == ["--notify", "PID"], tokens
    return tokens[1:-2]


def srun_steps(stdout: str) -> list[tuple[dict[str, str], list[str]]]:
    """(srun options, rlvla3 argv) of each printed step."""
    steps = []
    for line in stdout.splitlines()[1:]:
        tokens = shlex.split(line)
        assert tokens[0] == "srun", line
        prog = next(i for i, t in enumerate(tokens) if t.endswith("/bin/rlvla3"))
        opts = dict((t[2:].split("=", 1) + [""])[:2] for t in tokens[1:prog])
        assert set(opts) <= SRUN_OPTIONS, f"not srun options: {set(opts) - SRUN_OPTIONS}"
        steps.append((opts, tokens[prog + 1:]))
    return steps


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, t in enumerate(argv) if t == name]


def test_sbatch_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_renders_a_consistent_job(tmp_path: Path) -> None:
    nodes = ["n0", "n1", "n2", "n3", "n4", "n5"]
    proc = render_sbatch(tmp_path, RLVLA3_NODES=" ".join(nodes), GEN_NODES="2", TRAIN_NODES="2", GPUS_PER_NODE="4",
                         SIMS_PER_NODE="3", PORT="6000", PUB_PORT="6001", CONFIG="configs/synthetic.yaml")
    assert proc.returncode == 0, proc.stderr
    assert not any(tmp_path.iterdir()), "a dry run must not write anything"
    steps = srun_steps(proc.stdout)

    # -- the broker first, on the first node ----------------------------------------------------
    (b_opts, b_argv), workers = steps[0], steps[1:]
    assert b_argv[0] == "broker" and b_opts["nodelist"] == "n0"
    b = check_cli(b_argv)
    assert b["bind"] == "tcp://*:6000" and b["pub"] == "tcp://*:6001"
    cfg = load(str(ROOT / b["config"]), b["overrides"])  # the config exists and every --set is a real key
    w = check_cli(watch_line(proc.stdout))  # the watcher writes the run folder's config.yaml from the same
    assert (w["config"], w["overrides"], w["broker_url"]) == (b["config"], b["overrides"], "tcp://n0:6000")

    # -- every worker: real options, the broker's address, its role's nodes ----------------------
    by_role: dict[str, list[tuple[str, dict[str, Any]]]] = {r: [] for r in ROLES}
    for opts, argv in workers:
        assert argv[0] == "worker", argv
        w = check_cli(argv)
        assert w["broker_url"] == "tcp://n0:6000"
        by_role[w["role"]].append((opts["nodelist"], w))
    assert [n for n, _ in by_role["generator"]] == ["n1", "n2"]
    assert [n for n, _ in by_role["trainer"]] == ["n3", "n4"]
    assert [n for n, _ in by_role["simulator"]] == ["n0", "n5"]
    for opts, argv in workers:
        if argv[argv.index("--role") + 1] in ("generator", "trainer"):
            assert opts["gres"] == "gpu:4" and option(argv, "--gpus") == ["0-3"]

    # -- one trainer group, as large as the broker is told; no index used twice ------------------
    ranks = sum(len(parse_gpus(w["gpus"])) * w["count"] for _, w in by_role["trainer"])
    assert ranks == cfg.workers.trainers == 8
    assert all(w["run_dir"] for _, w in by_role["trainer"])
    for role, rows in by_role.items():
        used = [w["index"] + i for _, w in rows for i in range(max(len(parse_gpus(w["gpus"])), 1) * w["count"])]
        assert len(used) == len(set(used)), (role, used)
    assert sum(w["count"] for _, w in by_role["simulator"]) == 6


def test_sbatch_passes_the_keys_dir_to_every_process(tmp_path: Path) -> None:
    for env, keys in (({"KEYS_DIR": "/shared/keys"}, "/shared/keys"), ({"RUN_DIR": "/shared/run"}, "/shared/run/keys")):
        proc = render_sbatch(tmp_path, RLVLA3_NODES="a b c", **env)
        assert proc.returncode == 0, proc.stderr
        steps = srun_steps(proc.stdout)
        assert len(steps) == 4  # broker, generator, trainer, simulator
        for argv in [watch_line(proc.stdout)] + [argv for _, argv in steps]:
            assert option(argv, KEYS_OPTION) == [keys], argv  # made there when missing: the broker needs keys
            check_cli(argv)


def test_sbatch_runs_on_one_node_with_cpu_workers_when_it_has_no_gpus(tmp_path: Path) -> None:
    proc = render_sbatch(tmp_path, RLVLA3_NODES="n0", SIMS_PER_NODE="2")  # no GPU asked: no GPUS_PER_NODE
    assert proc.returncode == 0, proc.stderr
    steps = srun_steps(proc.stdout)
    assert [(o["nodelist"], a[0], check_cli(a).get("role")) for o, a in steps] == [
        ("n0", "broker", None), ("n0", "worker", "trainer"), ("n0", "worker", "generator"), ("n0", "worker", "simulator")]
    for opts, argv in steps:
        assert "gres" not in opts and "--gpus" not in argv, (opts, argv)
    assert option(steps[0][1], "--set") == ["workers.trainers=1"]


@pytest.mark.parametrize(("nodes", "gpus", "gen", "train"), [
    ("n0", "8", "0-3", "4-7"), ("n0", "1", "0", "0"), ("n0 n1", "2", "0", "1"), ("n0 n1 n2", "8", "0-7", "0-7")])
def test_sbatch_gives_gpu_workers_their_devices(tmp_path: Path, nodes: str, gpus: str, gen: str, train: str) -> None:
    """What ``sbatch --gpus-per-node=N`` sets (SLURM_GPUS_ON_NODE): one worker per GPU, and a node
    that runs both roles splits its GPUs."""
    proc = render_sbatch(tmp_path, RLVLA3_NODES=nodes, SLURM_GPUS_ON_NODE=gpus)
    assert proc.returncode == 0, proc.stderr
    steps = srun_steps(proc.stdout)
    by_role = {check_cli(a)["role"]: (o, a) for o, a in steps if a[0] == "worker"}
    assert option(by_role["generator"][1], "--gpus") == [gen] and option(by_role["trainer"][1], "--gpus") == [train]
    assert by_role["generator"][0]["gres"] == by_role["trainer"][0]["gres"] == f"gpu:{gpus}"
    assert "gres" not in by_role["simulator"][0]
    assert option(steps[0][1], "--set") == [f"workers.trainers={len(parse_gpus(train))}"]


def test_sbatch_resumes_a_run_folder(tmp_path: Path) -> None:
    proc = render_sbatch(tmp_path, RLVLA3_NODES="n0", RESUME="/shared/runs/slurm-7")
    assert proc.returncode == 0, proc.stderr
    w = check_cli(watch_line(proc.stdout))
    assert w["resume"] and w["run_dir"] == "/shared/runs/slurm-7" and w["config"] is None
    steps = srun_steps(proc.stdout)
    assert check_cli(steps[0][1])["config"] == "/shared/runs/slurm-7/config.yaml"
    trainer = next(check_cli(a) for _, a in steps if a[0] == "worker" and check_cli(a)["role"] == "trainer")
    assert trainer["resume"] == trainer["run_dir"] == "/shared/runs/slurm-7"
    proc = render_sbatch(tmp_path, RLVLA3_NODES="n0", RESUME="/r", CONFIG="configs/synthetic.yaml")
    assert proc.returncode == 2 and "unset CONFIG" in proc.stderr


def test_sbatch_refuses_a_layout_larger_than_the_allocation(tmp_path: Path) -> None:
    proc = render_sbatch(tmp_path, RLVLA3_NODES="a b", GEN_NODES="1", TRAIN_NODES="1")
    assert proc.returncode == 2
    assert "needs 1 + GEN_NODES (1) + TRAIN_NODES (1)" in proc.stderr
    assert proc.stdout == ""


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------

K8S_VERSION = "1.30"
"""The API version the manifests are validated against (the pod-index label needs >= 1.28)."""


@cache
def manifests() -> tuple[dict[str, Any], ...]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return tuple(docs)


def find(kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def workload(role: str) -> dict[str, Any]:
    return find("StatefulSet" if role == "simulator" else "Deployment", f"rlvla3-{role}")


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def rendered_args(c: dict[str, Any]) -> list[str]:
    """The container's args as Kubernetes expands them: ``$(VAR)`` from the container's env."""
    env = {e["name"]: e for e in c.get("env", [])}
    samples = {"metadata.name": "rlvla3-pod-0", "metadata.labels['apps.kubernetes.io/pod-index']": "3"}

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
        return samples[env[m.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]]

    return [re.sub(r"\$\((\w+)\)", sub, a) for a in c["args"]]


def test_manifests_parse_with_the_expected_objects() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    for d in manifests():
        assert {"apiVersion", "kind", "metadata"} <= set(d) and d["metadata"]["name"].startswith("rlvla3-"), d
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "rlvla3"
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in manifests())
    assert kinds == sorted([
        ("Service", "rlvla3-broker"), ("Deployment", "rlvla3-broker"), ("Deployment", "rlvla3-generator"),
        ("Deployment", "rlvla3-trainer"), ("PersistentVolumeClaim", "rlvla3-runs"),
        ("StatefulSet", "rlvla3-simulator"), ("Service", "rlvla3-simulator"),
    ])
    used = {container(workload(r))["image"].split(":")[0] for r in ("broker", *ROLES)}
    assert used == {i["name"] for i in kust["images"]}


def test_manifests_pass_the_kubernetes_api_schema() -> None:
    """Every object against the API's own OpenAPI schema (shipped with kubernetes-validate, so
    offline), strictly: an unknown or misplaced field fails as it would in ``kubectl apply``."""
    for d in manifests():
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(workload("trainer")))
    container(broken)["volumeMount"] = container(broken).pop("volumeMounts")  # a typo the schema must catch
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("role", ["broker", *ROLES])
def test_workload_labels_volumes_and_command(role: str) -> None:
    doc = workload(role)
    labels = doc["spec"]["template"]["metadata"]["labels"]
    assert labels == {"app.kubernetes.io/name": "rlvla3", "app.kubernetes.io/component": role}
    assert doc["spec"]["selector"]["matchLabels"] == labels == doc["metadata"]["labels"]
    c = container(doc)
    assert "/" not in c["image"] and "." not in c["image"].split(":")[0], f"{c['image']}: no registry host in the recipes"
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) == set(volumes), (sorted(mounts), sorted(volumes))
    assert volumes["keys"]["secret"]["secretName"] == f"rlvla3-keys-{role}"
    assert mounts["keys"]["readOnly"] is True and volumes["keys"]["secret"]["defaultMode"] == 0o400
    assert c["command"] == ["rlvla3"]
    args = rendered_args(c)
    params = check_cli(args)
    assert option(args, KEYS_OPTION) == [mounts["keys"]["mountPath"]]
    if role == "broker":
        assert (Path(mounts["job"]["mountPath"]) / "job.yaml") == Path(params["config"])
        assert volumes["job"]["configMap"]["name"] == "rlvla3-job" and doc["spec"]["strategy"]["type"] == "Recreate"
        assert doc["spec"]["replicas"] == 1
        return
    assert params["role"] == role and params["count"] == 1
    if role != "simulator":
        gpus = len(parse_gpus(params["gpus"]))
        assert gpus == c["resources"]["limits"]["nvidia.com/gpu"] == 1
    else:
        assert params["index"] == 3  # the pod's ordinal, so no two simulators share seeds or env ids
        assert doc["spec"]["serviceName"] == "rlvla3-simulator"
        assert find("Service", "rlvla3-simulator")["spec"]["clusterIP"] == "None"
    assert "medium" in volumes["dshm"]["emptyDir"] and mounts["dshm"]["mountPath"] == "/dev/shm"


def test_manifests_run_the_commands_the_slurm_recipe_runs(tmp_path: Path) -> None:
    """The pods run what tests/test_slurm.py proved on a real Slurm: the same rlvla3 command per
    role, with no option the Slurm steps do not use (but ``--name``, from the pod's name)."""
    proc = render_sbatch(tmp_path, RLVLA3_NODES="n0 n1 n2", SLURM_GPUS_ON_NODE="1")
    assert proc.returncode == 0, proc.stderr
    slurm = {}
    for _, argv in srun_steps(proc.stdout):
        slurm["broker" if argv[0] == "broker" else check_cli(argv)["role"]] = (argv[0], {t for t in argv if t.startswith("--")})
    for role in ("broker", *ROLES):
        args = rendered_args(container(workload(role)))
        command, options = slurm[role]
        assert args[0] == command, (role, args)
        assert {t for t in args if t.startswith("--")} - {"--name"} <= options, (role, args, options)


def test_broker_service_ports_and_addresses_agree() -> None:
    svc = find("Service", "rlvla3-broker")
    broker = workload("broker")
    assert svc["spec"]["selector"] == broker["spec"]["template"]["metadata"]["labels"]
    c = container(broker)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # generators connect to the PUB port the broker reports, on the Service's host: same numbers
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)
    params = check_cli(rendered_args(c))
    assert params["bind"] == f"tcp://*:{ports['router']}" and params["pub"] == f"tcp://*:{ports['pub']}"
    assert c["readinessProbe"]["tcpSocket"]["port"] in ports
    for role in ROLES:
        w = check_cli(rendered_args(container(workload(role))))
        assert w["broker_url"] == f"tcp://{svc['metadata']['name']}:{ports['router']}", role


def test_trainer_group_size_matches_the_broker() -> None:
    broker = check_cli(rendered_args(container(workload("broker"))))
    cfg = load(str(ROOT / "configs" / "synthetic.yaml"), broker["overrides"])  # every --set is a real key
    trainer = workload("trainer")
    assert trainer["spec"]["replicas"] == cfg.workers.trainers
    t = container(trainer)
    params = check_cli(rendered_args(t))
    runs = {m["name"]: m for m in t["volumeMounts"]}["runs"]["mountPath"]
    assert Path(params["run_dir"]).is_relative_to(runs)
    claim = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}["runs"]["persistentVolumeClaim"]
    pvc = find("PersistentVolumeClaim", claim["claimName"])
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]


# ---------------------------------------------------------------------------------------------
# Dockerfiles
# ---------------------------------------------------------------------------------------------

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction, as Docker reads them: comment lines dropped (also inside
    a continued instruction), a backslash-newline removed."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or (not pending and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]
            continue
        text = pending + line
        pending = ""
        keyword, _, rest = text.strip().partition(" ")
        out.append((keyword, rest.strip()))
    assert not pending, f"{path.name}: ends inside a continued line"
    return out


def pinned_torch() -> str:
    m = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts" / "bootstrap.sh").read_text())
    assert m, "scripts/bootstrap.sh pins no torch"
    return m.group(1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dockerfile_parses_and_installs_real_extras(family: str) -> None:
    path = DEPLOY / "docker" / f"{family}.Dockerfile"
    ins = instructions(path)
    bad = [k for k, _ in ins if k not in INSTRUCTIONS]
    assert not bad, f"{path.name}: not Dockerfile instructions: {bad}"
    first = next(i for i, (k, _) in enumerate(ins) if k != "ARG")
    assert ins[first][0] == "FROM" and sum(k == "FROM" for k, _ in ins) == 1

    args = dict(a.split("=", 1) if "=" in a else (a, "") for k, a in ins if k == "ARG")
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ins[first][1])
    assert image == "python:3.11-slim-bookworm", image  # no registry host: the builder's default
    assert args["TORCH_VERSION"] == pinned_torch()

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installed: set[str] = set()
    ignored = (ROOT / ".dockerignore").read_text().split()
    for keyword, rest in ins:
        if keyword == "RUN":
            script = re.sub(r"^(--\w+=\S+\s+)+", "", rest)
            proc = subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True, timeout=30)
            assert proc.returncode == 0, f"{path.name}: RUN does not parse: {proc.stderr}\n{script}"
            for group in re.findall(r'pip install [^;&|]*?"?\.\[([\w,-]+)\]', script):
                installed |= set(group.split(","))
            assert "://" not in script, f"{path.name}: no URL is written in the recipes"
        if keyword == "COPY":
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
                assert src not in ignored, f"{path.name}: COPY {src}, but .dockerignore drops it"
    assert installed <= extras, f"{path.name}: extras not in pyproject.toml: {installed - extras}"
    want = FAMILIES[family]
    assert installed == ({want} if want else set()), (family, installed)
    assert ("ENTRYPOINT", '["rlvla3"]') in ins


def test_recipes_write_no_web_address() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.is_file()] + [ROOT / ".dockerignore"]
    assert len(files) >= 9
    for p in files:
        assert not re.search(r"https?://", p.read_text()), f"{p}: recipes name no host (registries included)"
