"""deploy/kubernetes: the manifests parse, and what they run is what Muster accepts. The commands
go through muster's own CLI parser and torchrun translation; probes, ports and addresses agree
between the coordinator, etcd and the training job."""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from muster.cli import parser  # noqa: E402
from muster.cli.serve import check_listen as _check_listen  # noqa: E402
from muster.worker.agent.launch import plan  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def manifests() -> dict[tuple[str, str], dict]:
    docs = [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def expand(args: list[str], **env: str) -> list[str]:
    """Kubernetes' $(VAR) substitution in args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_named(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def test_three_coordinators_with_probes_on_their_metrics_port_against_the_etcd_cluster():
    m = manifests()
    etcd, coord = m[("StatefulSet", "muster-etcd")], m[("StatefulSet", "muster-coordinator")]
    assert coord["spec"]["replicas"] == 3 and etcd["spec"]["replicas"] == 3
    c = container(coord)
    args = parser().parse_args(expand(c["args"], POD_NAME="muster-coordinator-1"))
    assert args.command == "serve"
    members = [f"muster-etcd-{i}.{etcd['spec']['serviceName']}:2379" for i in range(etcd["spec"]["replicas"])]
    assert args.etcd.split(",") == members
    assert args.advertise == f"muster-coordinator-1.{coord['spec']['serviceName']}:{port_named(c, 'grpc')}"
    assert args.listen.endswith(f":{port_named(c, 'grpc')}")
    assert args.metrics_listen.endswith(f":{port_named(c, 'metrics')}")
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics", "scheme": "HTTPS"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTPS"}
    service = m[("Service", "muster-coordinator")]
    assert service["spec"]["selector"] == coord["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"  # stable per-pod names


def test_etcd_members_name_each_other():
    etcd = manifests()[("StatefulSet", "muster-etcd")]
    command = expand(container(etcd)["command"], POD_NAME="muster-etcd-0")
    cluster = next(a for a in command if a.startswith("--initial-cluster=")).split("=", 1)[1]
    assert [entry.split("=")[0] for entry in cluster.split(",")] == [f"muster-etcd-{i}" for i in range(3)]


def test_the_training_pod_runs_the_agent_wrapping_torchrun_at_the_coordinators():
    m = manifests()
    job, coord = m[("Job", "llm-train")], m[("StatefulSet", "muster-coordinator")]
    c = container(job)
    assert c["command"] == ["muster"]
    args = parser().parse_args(expand(c["args"], POD_NAME="llm-train-0-x", POD_IP="10.0.0.5"))
    assert args.node_id == "llm-train-0-x" and args.host == "10.0.0.5" and args.command[0] == "--"  # muster run
    port = port_named(container(coord), "grpc")
    assert args.coordinator.split(",") == [f"muster-coordinator-{i}.muster-coordinator:{port}" for i in range(3)]
    launch = plan(args.command[1:])
    assert launch.slots == c["resources"]["limits"]["nvidia.com/gpu"]
    low, high = (int(n) for n in args.nodes.split(":"))
    assert low <= job["spec"]["parallelism"] == high


def mounted(workload: dict, path: str) -> str:
    """The Secret a file of the container comes from (its volume mounted above `path`)."""
    c = container(workload)
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"]


def test_secure_by_default_tls_tokens_from_secrets_and_etcd_client_certificates():
    m = manifests()
    coord, etcd = m[("StatefulSet", "muster-coordinator")], m[("StatefulSet", "muster-etcd")]
    job = m[("Job", "llm-train")]
    serve = parser().parse_args(expand(container(coord)["args"], POD_NAME="muster-coordinator-0"))
    assert mounted(coord, serve.tls_cert) == mounted(coord, serve.tls_key) == "muster-coordinator-tls"
    assert mounted(coord, serve.tokens) == "muster-tokens"
    assert mounted(coord, serve.etcd_cert) == mounted(coord, serve.etcd_cacert) == "muster-etcd-client-tls"
    run = parser().parse_args(expand(container(job)["args"], POD_NAME="p", POD_IP="10.0.0.5"))
    assert run.token == "" and mounted(job, run.token_file) == "muster-token-llm-train"  # never on the command line
    assert mounted(job, run.tls_ca) == "muster-coordinator-tls"
    flags = expand(container(etcd)["command"], POD_NAME="muster-etcd-0")
    assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
    assert not [f for f in flags if "urls=http://" in f and not f.startswith("--listen-metrics-urls")]


def test_the_page_and_metrics_are_served_over_https_behind_the_tokens():
    """The page takes tokens, operators' too (review 5, M3): the metrics port serves HTTPS with the
    gRPC port's certificate, and the probes and Prometheus speak it; /metrics asks a token."""
    coord = manifests()[("StatefulSet", "muster-coordinator")]
    c = container(coord)
    serve = parser().parse_args(expand(c["args"], POD_NAME="muster-coordinator-0"))
    assert serve.http and serve.tokens and serve.tls_cert and not serve.insecure and not serve.metrics_open
    assert not serve.metrics_listen.startswith("127.")  # beyond loopback: accepted only with TLS
    _check_listen(serve, tls=True)
    with pytest.raises(ValueError, match="takes their tokens"):
        _check_listen(serve, tls=False)
    assert {c[p]["httpGet"]["scheme"] for p in ("readinessProbe", "livenessProbe")} == {"HTTPS"}
    assert coord["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"


def test_a_network_policy_admits_only_the_coordinators_to_etcd_and_only_the_job_to_its_stores():
    m = manifests()
    policies = {name: d["spec"] for (kind, name), d in m.items() if kind == "NetworkPolicy"}
    workloads = [d for (kind, _), d in m.items() if kind in ("StatefulSet", "Job")]
    for w in workloads:  # every pod is selected by a policy
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(p["podSelector"]["matchLabels"].items() <= labels.items() for p in policies.values()), labels
    etcd_clients = [r for r in policies["muster-etcd"]["ingress"] if {"port": 2379} in r["ports"]]
    assert [r["from"] for r in etcd_clients] == [[{"podSelector": {"matchLabels": {"app": "muster-coordinator"}}}]]
    assert policies["llm-train"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "llm-train"}}}]}]
    node_labels = m[("Job", "llm-train")]["spec"]["template"]["metadata"]["labels"]
    grpc = next(r for r in policies["muster-coordinator"]["ingress"] if {"port": 7600} in r["ports"])
    assert any(f["podSelector"]["matchLabels"].items() <= node_labels.items() for f in grpc["from"])


def test_the_systemd_unit_serves_beyond_loopback_with_tls_and_tokens():
    unit = (DEPLOY.parent / "systemd" / "muster-serve.service").read_text()
    env = dict(line.split("=", 1) for line in (DEPLOY.parent / "systemd" / "serve.env").read_text().splitlines()
               if line and not line.startswith("#"))
    exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", unit, re.MULTILINE | re.DOTALL).group(1).replace("\\\n", " ")
    argv = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], exec_start).split()
    assert argv[0].endswith("/muster")
    serve = parser().parse_args(argv[1:])
    assert serve.command == "serve" and serve.listen == "0.0.0.0:7600"
    assert serve.tls_cert and serve.tls_key and serve.tokens and serve.etcd_cacert and serve.etcd_cert
    assert serve.advertise == env["MUSTER_ADVERTISE"] and serve.etcd == env["MUSTER_ETCD"]
    assert "KillSignal=SIGTERM" in unit and "Restart=always" in unit
