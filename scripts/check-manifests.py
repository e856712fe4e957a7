#!/usr/bin/env python3
"""Checks the rendered Kubernetes manifests offline:

    kubectl kustomize deploy/kubernetes > rendered.yaml
    python scripts/check-manifests.py rendered.yaml

Every object against the Kubernetes API's schema (kubernetes-validate, which
bundles them), strictly: an unknown field, a wrong type or an unknown kind
fails. Then what no schema sees: the references between objects (volumes,
ConfigMaps and Secrets, named ports, the selectors of Services,
PodDisruptionBudgets and NetworkPolicies), and that kiln.toml in the Secret
agrees with the Deployment and the others (its listen port; its [state]
replicas is the HorizontalPodAutoscaler's minReplicas; the password in its
[state] redis URL is Redis's, from the Secret redis-auth, and the one in its
[batch] store URL is PostgreSQL's, from the Secret postgres-auth), and that
Redis has a password and never evicts.
Exits 1 with one line per finding.
"""

import base64
import sys
import tomllib

import kubernetes_validate
import yaml

# The oldest Kubernetes release these manifests are meant for (every field
# they use is GA there) and the newest the bundled schemas know.
VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]

findings = []


def find(msg):
    findings.append(msg)


def name(o):
    return f"{o['kind']}/{o['metadata']['name']}"


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


with open(sys.argv[1]) as f:
    objects = [o for o in yaml.safe_load_all(f) if o]

for o in objects:
    for v in VERSIONS:
        try:
            kubernetes_validate.validate(o, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            find(f"{name(o)}: {path}: {e.message} (Kubernetes {v})")
        except kubernetes_validate.SchemaNotFoundError:
            find(f"{name(o)}: no schema for {o['apiVersion']} {o['kind']} (Kubernetes {v})")

by_kind = {}
for o in objects:
    by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
workloads = list(by_kind.get("Deployment", {}).values()) + list(by_kind.get("StatefulSet", {}).values())


def pod_labels(d):
    return d["spec"]["template"]["metadata"].get("labels", {})


def port_names(d):
    return {
        p["name"]: p["containerPort"]
        for c in d["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
        if "name" in p
    }


for d in workloads:
    spec = d["spec"]["template"]["spec"]
    if not matches(d["spec"]["selector"].get("matchLabels"), pod_labels(d)):
        find(f"{name(d)}: its selector does not match its pod labels")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    # A StatefulSet's claims are volumes of its pods too.
    for t in d["spec"].get("volumeClaimTemplates", []):
        volumes[t["metadata"]["name"]] = {"name": t["metadata"]["name"]}
    for v in volumes.values():
        if "configMap" in v and v["configMap"]["name"] not in by_kind.get("ConfigMap", {}):
            find(f"{name(d)}: volume {v['name']} names a ConfigMap not rendered: {v['configMap']['name']}")
        if "secret" in v and v["secret"]["secretName"] not in by_kind.get("Secret", {}):
            find(f"{name(d)}: volume {v['name']} names a Secret not rendered: {v['secret']['secretName']}")
    ports = port_names(d)
    for c in spec["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                find(f"{name(d)}: container {c['name']} mounts an undeclared volume {m['name']}")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            for action in ("httpGet", "tcpSocket"):
                port = c.get(probe, {}).get(action, {}).get("port")
                if isinstance(port, str) and port not in ports:
                    find(f"{name(d)}: {probe} uses the unknown port name {port}")

for s in by_kind.get("Service", {}).values():
    targets = [d for d in workloads if matches(s["spec"].get("selector"), pod_labels(d))]
    if not targets:
        find(f"{name(s)}: its selector matches no Deployment's pods")
    for p in s["spec"]["ports"]:
        t = p.get("targetPort")
        if isinstance(t, str) and not any(t in port_names(d) for d in targets):
            find(f"{name(s)}: targetPort {t} is no port of the pods it selects")

for p in by_kind.get("PodDisruptionBudget", {}).values():
    targets = [d for d in workloads if matches(p["spec"]["selector"].get("matchLabels"), pod_labels(d))]
    if not targets:
        find(f"{name(p)}: its selector matches no Deployment's pods")
    for d in targets:
        fewest = d["spec"].get("replicas", 1)
        for h in by_kind.get("HorizontalPodAutoscaler", {}).values():
            if h["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]:
                fewest = h["spec"].get("minReplicas", 1)
        if "minAvailable" in p["spec"] and p["spec"]["minAvailable"] >= fewest:
            find(f"{name(p)}: minAvailable leaves no pod of {name(d)} to evict at {fewest} replicas (a node drain would hang)")

for h in by_kind.get("HorizontalPodAutoscaler", {}).values():
    ref = h["spec"]["scaleTargetRef"]
    if ref["name"] not in by_kind.get(ref["kind"], {}):
        find(f"{name(h)}: scales {ref['kind']}/{ref['name']}, which is not rendered")

for n in by_kind.get("NetworkPolicy", {}).values():
    if not any(matches(n["spec"]["podSelector"].get("matchLabels"), pod_labels(d)) for d in workloads):
        find(f"{name(n)}: its podSelector matches no Deployment's pods")

# kiln.toml, as the gateway reads it from the Secret.
kiln = by_kind.get("Deployment", {}).get("kiln")
configs = [s for s in by_kind.get("Secret", {}).values() if "kiln.toml" in s.get("data", {})]
if kiln is None or len(configs) != 1:
    find("expected the Deployment kiln and one Secret holding kiln.toml")
else:
    toml = tomllib.loads(base64.b64decode(configs[0]["data"]["kiln.toml"]).decode())
    replicas = toml.get("state", {}).get("replicas")
    hpas = [h for h in by_kind.get("HorizontalPodAutoscaler", {}).values() if h["spec"]["scaleTargetRef"]["name"] == "kiln"]
    fewest = hpas[0]["spec"].get("minReplicas", 1) if hpas else kiln["spec"].get("replicas", 1)
    if replicas != fewest:
        find(f"kiln.toml [state] replicas = {replicas}, the fewest the Deployment runs is {fewest}")
    # Redis's password: the one in kiln.toml's URL is the Secret's.
    url = toml.get("state", {}).get("redis", "")
    auth = [s for s in by_kind.get("Secret", {}).values() if s["metadata"]["name"].startswith("redis-auth")]
    if len(auth) != 1 or "password" not in auth[0].get("data", {}):
        find("expected one Secret redis-auth holding Redis's password")
    else:
        password = base64.b64decode(auth[0]["data"]["password"]).decode()
        if f":{password}@" not in url:
            find("kiln.toml [state] redis does not carry the password of the Secret redis-auth")
    # PostgreSQL's password (the shared batch store), likewise.
    store = str(toml.get("batch", {}).get("store", ""))
    if store.startswith(("postgres://", "postgresql://")):
        auth = [s for s in by_kind.get("Secret", {}).values() if s["metadata"]["name"].startswith("postgres-auth")]
        if len(auth) != 1 or "password" not in auth[0].get("data", {}):
            find("expected one Secret postgres-auth holding PostgreSQL's password")
        elif f":{base64.b64decode(auth[0]['data']['password']).decode()}@" not in store:
            find("kiln.toml [batch] store does not carry the password of the Secret postgres-auth")
    redis = by_kind.get("StatefulSet", {}).get("redis")
    if redis is not None:
        args = [a for c in redis["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
        for flag, value in (("--maxmemory-policy", "noeviction"), ("--requirepass", None)):
            if flag not in args or (value is not None and args[args.index(flag) + 1] != value):
                find(f"StatefulSet/redis: expected {flag} {value or '…'} in its args")
    listen = toml.get("listen", "")
    if not listen.startswith("0.0.0.0:"):
        find(f"kiln.toml listen = {listen!r}: in a pod kiln must listen on 0.0.0.0")
    elif int(listen.rsplit(":", 1)[1]) not in port_names(kiln).values():
        find(f"kiln.toml listens on {listen}, not on a containerPort of the Deployment")

for f in findings:
    print(f"check-manifests: {f}", file=sys.stderr)
if findings:
    sys.exit(1)
print(f"check-manifests: {len(objects)} objects valid for Kubernetes {', '.join(VERSIONS)}; references resolve")
